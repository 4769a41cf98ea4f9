import json
import os
import pkgutil
from pathlib import Path

import pytest

# Inductor compiles a worker's kernels in the worker: by default each xdist worker would start a pool of one compile
# process per core (16 workers x 16 processes on the GPU machine, each importing torch) to share the same cores.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch  # noqa: E402
from torch.utils._config_module import ConfigModule

# Without a GPU, Triton kernels run under the interpreter; it is chosen when kernels are decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist's workers share the cores: each takes its part rather than all of them.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


_config = []  # the run's config, in the process that prints the run


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # xdist's workers print nothing; their reports reach the controller
        _config.append(config)


def pytest_runtest_logreport(report):
    """Each failure the moment it happens, with its last line, on the process that prints the run (xdist's
    controller gets every worker's reports): a run cut by a time limit still names what failed."""
    terminal = _config[-1].pluginmanager.get_plugin("terminalreporter") if _config else None
    if not report.failed or terminal is None:
        return
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None) or str(report.longrepr)
    terminal.write("\n")  # off the progress line
    terminal.write_line(f"FAILED {report.nodeid} ({report.when}): {crash.strip().splitlines()[0][:200]}", red=True)


# The seconds each test of at least a second took in the GPU suite (`.ci/durations.py` writes it from a run's JUnit
# XML). The tests are collected longest first, and handed to xdist's workers one at a time (pyproject's --dist
# loadgroup; a group's tests go together, the group first), so that no long test starts late and leaves one worker
# running at the end: on the H100 at 1ef4406, ordered by file, the slowest first, the suite's 3309 worker-seconds took
# 274 s on 16 workers. Tests not in the file (shorter, or new) keep their collection order after the rest.
DURATIONS = json.loads((Path(__file__).parent / "tests" / "durations.json").read_text())


def pytest_collection_modifyitems(config, items):
    # stable: tests of equal (or no) recorded time keep their order; xdist's `@group` suffix is not in the file
    items.sort(key=lambda item: -DURATIONS.get(item.nodeid.split("@")[0], 0.0))
    # CI's 2 cores: the slowest cases run on the GPU machine (cpu_matrix as a second command,
    # docs/decisions/0014-gpu-suite-cpu-matrix-second-command.md) and locally
    if os.environ.get("CI") == "true":
        slow = pytest.mark.skip(reason="slow: skipped where CI=true; .ci/gpu (or .ci/gpu --cpu-matrix) runs it")
        for item in items:
            if "slow" in item.keywords or "cpu_matrix" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_UNSET = object()  # an argument not given


class ConfigRefusingMonkeyPatch(pytest.MonkeyPatch):
    """monkeypatch, refusing torch's config modules (torch._dynamo.config, torch._inductor.config, ...): undoing such
    a patch broke torch's config for every later test in the same worker (`enable_autograd_cache does not exist`),
    so the suite failed or passed by which worker got which test. The config's own patch() undoes cleanly."""

    def setattr(self, target, name, value=_UNSET, raising=True):
        self._refuse_config(target, name, value)
        if value is _UNSET:  # the dotted form, setattr("package.module.attr", value)
            return super().setattr(target, name, raising=raising)
        return super().setattr(target, name, value, raising=raising)

    def delattr(self, target, name=_UNSET, raising=True):
        self._refuse_config(target, name, name)
        if name is _UNSET:
            return super().delattr(target, raising=raising)
        return super().delattr(target, name, raising=raising)

    @staticmethod
    def _refuse_config(target, name, value):
        # The dotted form ("torch._inductor.config.x", value) names the attribute inside the target string.
        if isinstance(target, str) and value is _UNSET:
            path, _, name = target.rpartition(".")
            target = pkgutil.resolve_name(path)
        if isinstance(target, ConfigModule):
            raise TypeError(f"monkeypatch of torch's config {target.__name__}.{name}: use the config's own patch() "
                            f"context instead, `with {target.__name__}.patch({name}=...)`")


@pytest.fixture
def monkeypatch():
    with ConfigRefusingMonkeyPatch.context() as patch:
        yield patch
