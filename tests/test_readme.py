"""The README's examples run as written: each code block marked `<!-- README block: runs -->` runs as a script in a
fresh process (one marked `runs with torchrun --nproc-per-node N` under torchrun, over gloo on the CPU)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- README block: runs(?: with torchrun --nproc-per-node (\d+))? -->\n```python\n(.*?)```",
                   re.S)
BLOCKS = BLOCK.findall((ROOT / "README.md").read_text())


def block_id(block) -> str:
    first = next(line for line in block[1].splitlines() if line and not line.startswith(("import", "from", "#")))
    return re.sub(r"\W+", "_", first)[:40]


def test_the_readme_marks_its_runnable_blocks():
    assert len(BLOCKS) >= 6 and any(ranks for ranks, _ in BLOCKS)


def on_any_machine(block) -> list:
    """A block that runs on the CPU here, as CI runs it, goes on a GPU machine to the second command (`cpu_only`),
    not the suite's one call: one that never names CUDA, and one under torchrun with more ranks than this machine
    has GPUs (its ranks fall back to gloo on the CPU)."""
    ranks, code = block
    on_the_cpu = "cuda" not in code or (ranks and torch.cuda.device_count() < int(ranks))
    return [pytest.mark.cpu_only] if on_the_cpu else []


@pytest.mark.parametrize("block", [pytest.param(block, marks=on_any_machine(block)) for block in BLOCKS], ids=block_id)
def test_a_readme_block_runs_as_written(tmp_path, block):
    ranks, code = block
    (tmp_path / "block.py").write_text(code)
    if ranks:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks, "block.py"]
    else:
        command = [sys.executable, "block.py"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + failure_summary(done.stderr)


def failure_summary(stderr: str) -> str:
    """A failed block's traceback from its start, the compiler's `error:` lines (a C++ compile error's message ends
    in pages of warnings), and the end of stderr."""
    start = stderr.find("Traceback")
    errors = [line for line in stderr.splitlines() if "error:" in line][:10]
    return "\n".join([stderr[start:start + 2500] if start >= 0 else "", *errors, "...", stderr[-1500:]])
