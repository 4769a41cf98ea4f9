"""The suite passes in any order: no test may monkeypatch torch's config modules (conftest's monkeypatch refuses),
since undoing such a patch broke the config for every later test in the same worker."""
import pytest
import torch
import torch._dynamo.config
import torch._functorch.config
import torch._inductor.config


@pytest.mark.parametrize("patch", [
    lambda mp: mp.setattr(torch._functorch.config, "enable_autograd_cache", False),
    lambda mp: mp.setattr("torch._inductor.config.max_autotune", True),
    lambda mp: mp.delattr(torch._dynamo.config, "cache_size_limit"),
], ids=["object", "dotted", "delattr"])
def test_monkeypatch_refuses_torch_config_and_names_the_fix(monkeypatch, patch):
    with pytest.raises(TypeError, match=r"use the config's own patch\(\) context"):
        patch(monkeypatch)
    assert torch._functorch.config.enable_autograd_cache in (True, False)  # still there, whatever was tried
    assert torch._dynamo.config.cache_size_limit > 0


def test_monkeypatch_still_patches_and_undoes_everything_else(monkeypatch):
    import fxquant.quantization.weight_quantization as weight_quantization

    before = weight_quantization.CHUNK_ELEMENTS, weight_quantization.ROUTER_REASON
    monkeypatch.setattr(weight_quantization, "CHUNK_ELEMENTS", 7)
    monkeypatch.setattr("fxquant.quantization.weight_quantization.ROUTER_REASON", "patched")
    assert (weight_quantization.CHUNK_ELEMENTS, weight_quantization.ROUTER_REASON) == (7, "patched")
    monkeypatch.undo()
    assert before == (weight_quantization.CHUNK_ELEMENTS, weight_quantization.ROUTER_REASON)


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_failure_is_printed_the_moment_it_happens(tmp_path, workers):
    """A run cut by a time limit (the GPU machine's call) still names what failed: the failure's line comes before
    the run ends (with -q, before the last test's progress mark), under xdist too."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "durations.json").write_text("{}")  # conftest's order: none recorded
    (tmp_path / "test_cut.py").write_text(
        "import time\n"
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n"
        "def test_after():\n    time.sleep(1)\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", workers,
                          str(tmp_path)], cwd=tmp_path, capture_output=True, text=True).stdout
    live = "FAILED test_cut.py::test_fails (call): AssertionError: one is not two"
    assert live in out and out.index(live) < out.index("[100%]"), out  # before the run's last test has ended


def test_the_longest_tests_come_first_one_test_at_a_time_and_a_group_stays_on_one_worker(tmp_path):
    """xdist's default load schedule hands each worker a chunk of consecutive tests first (5 of 46 here): the slowest
    tests, collected first, would all land on one worker. With pyproject's options and conftest, the tests that
    tests/durations.json records longest come first, one test at a time, and the tests of one xdist_group (a module
    fixture's) share a worker."""
    import json
    import re
    import shlex
    import shutil
    import subprocess
    import sys
    from pathlib import Path


    root = Path(__file__).parents[1]
    addopts = shlex.split(re.search(r'^addopts = "(.*)"$', (root / "pyproject.toml").read_text(), re.M).group(1))
    assert "loadgroup" in addopts
    addopts[addopts.index("-n") + 1] = "3"
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "tests").mkdir()  # the last file's first four tests recorded longest
    longest = {f"test_z_slow.py::test_one[{i}]": 10.0 + (3 - i) for i in range(4)}
    (tmp_path / "tests" / "durations.json").write_text(json.dumps({**longest, "test_a_fast.py::test_one[5]": 0.5}))
    record = ("import os, pathlib, time, pytest\n"
              "@pytest.mark.parametrize('i', range(20))\n"
              "def test_one(i):\n"
              "    pathlib.Path(f'{__name__}-{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n"
              "    pathlib.Path(f'{__name__}-{i}.start').write_text(str(time.monotonic_ns()))\n")
    grouped = ("import os, pathlib, pytest\n"
               "@pytest.mark.xdist_group('fixture')\n"
               "@pytest.mark.parametrize('i', range(6))\n"
               "def test_one(i):\n"
               "    pathlib.Path(f'{__name__}-{i}').write_text(os.environ['PYTEST_XDIST_WORKER'])\n")
    (tmp_path / "test_a_fast.py").write_text(record)
    (tmp_path / "test_z_slow.py").write_text(record)
    (tmp_path / "test_b_grouped.py").write_text(grouped)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          *addopts, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True)
    assert "46 passed" in out.stdout, out.stdout + out.stderr
    group = {(tmp_path / f"test_b_grouped-{i}").read_text() for i in range(6)}
    first = {(tmp_path / f"test_z_slow-{i}").read_text() for i in range(4)}
    assert len(group) == 1, group  # the group ran on one worker (it was handed out first: the largest scope)
    assert first == {"gw0", "gw1", "gw2"} - group, first  # the four longest, collected last, on both other workers
    start = {(name, i): int((tmp_path / f"{name}-{i}.start").read_text()) for name in ("test_a_fast", "test_z_slow")
             for i in range(20)}
    worker = {(name, i): (tmp_path / f"{name}-{i}").read_text() for name, i in start}
    # ahead of the unrecorded on each worker, which runs its tests one after another; across workers the start times
    # race (a busy machine may pause one worker's start while another runs through fast tests)
    for each in first:
        longest = [start[key] for key in start if key[0] == "test_z_slow" and key[1] < 4 and worker[key] == each]
        unrecorded = [start[key] for key in start if key[0] == "test_a_fast" and key[1] >= 10 and worker[key] == each]
        assert not unrecorded or max(longest) < min(unrecorded), (each, start, worker)


def _rank_that_dies() -> dict:
    import os

    import torch.distributed as dist

    # both ranks past their group's setup first: a rank 0 that returned at once and tore its group down could end
    # rank 1's setup with gloo's "connection closed by peer" before it reached its exit (under the GPU suite's load)
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(3)  # as a rank the OOM killer ends, or one that crashes in the interpreter: no result, no traceback
    return {}


def test_a_rank_that_dies_without_a_result_fails_the_run_at_once_naming_it():
    """The ranks' results come through a queue; a rank killed before it put its own left the test waiting for the
    whole timeout (600 s), with nothing to say why."""
    import time

    from tensor_parallel import run

    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[1\] ended with exit codes \[3\] and no result"):
        run(2, _rank_that_dies)
    assert time.monotonic() - start < 120


def test_a_run_s_durations_update_its_tests_and_keep_the_other_command_s():
    """`.ci/gpu` and `.ci/gpu --cpu-matrix` run disjoint tests: refreshing tests/durations.json from one command's
    JUnit XML must keep the other's recorded seconds, or its long tests lose their place at the front."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("durations", Path(__file__).parents[1] / ".ci" / "durations.py")
    durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(durations)
    recorded = {"t.py::gpu_long": 90.0, "t.py::cpu_long": 80.0, "t.py::now_fast": 5.0, "t.py::removed": 70.0}
    ran = {"t.py::gpu_long": 95.5, "t.py::now_fast": 0.4, "t.py::new": 3.0, None: 9.0}  # None: a file since removed
    tests = {"t.py::gpu_long", "t.py::cpu_long", "t.py::now_fast", "t.py::new"}
    assert durations.merged(recorded, ran, tests) == {"t.py::cpu_long": 80.0, "t.py::gpu_long": 95.5, "t.py::new": 3.0}
