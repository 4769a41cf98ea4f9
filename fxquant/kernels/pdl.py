"""Programmatic dependent launch (sm_90+) between fxquant's kernels.

A kernel launched with `launch_pdl` may start while the kernel before it in the stream is still running: its launch
and prologue overlap that kernel's tail. Every such kernel calls `wait_for_inputs` before its first load, which
blocks until the previous grid has completed and its writes are visible, then lets the next kernel launch early in
turn. A kernel that was not launched this way (Inductor's, cuBLAS) is ordered as usual, and the wait is a no-op
after it. Off sm_90 and under the interpreter, which lack the instructions, kernels launch as usual.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fxquant.kernels.cast import capability, interpreting

ENABLED = True  # bench/e2e.py --no-pdl turns it off, to measure what it brings


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Before a kernel's first load: wait for the previous grid, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_options(kernel, device: torch.device) -> dict:
    """The PDL constexpr and launch option for launching `kernel` on `device`."""
    on = ENABLED and not interpreting(kernel) and device.type == "cuda" and capability(device) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
