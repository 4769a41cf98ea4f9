import os

import pytest
import torch

# Without a GPU, Triton kernels run under the interpreter; it is chosen when kernels are decorated.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# pytest-xdist's workers share the cores: each takes its part rather than all of them.
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CI") == "true":  # CI's 2 cores: the slowest cases run on the GPU machine and locally
        slow = pytest.mark.skip(reason="slow: skipped where CI=true; .ci/gpu runs it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
