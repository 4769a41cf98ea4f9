"""Programmatic dependent launch (sm_90+): a kernel starts while the one before it in the stream finishes.

A kernel launched with `launch_pdl` may have its programs resident while the previous kernel's last programs still
run. Each of its programs first waits (griddepcontrol.wait) until that kernel has finished and its writes are
visible, then lets the next kernel begin its own launch. Between the dozen dependent kernels of a decode layer this
hides the launch and tail each one otherwise waits for; stream capture keeps the edges, so CUDA graphs keep it.

The wait comes before any load or store, so every result is the serial launch's, bit for bit. Before it, a GEMM
may ask L2 for the first lines of its weight slice (`prefetch_lines`): a hint that writes no register, and L2 is
where every SM's writes meet, so the values read after the wait are the same either way. After a kernel
launched without it (Inductor's, cuBLAS's), a kernel launched with it starts when that one ends, as before.
FXQUANT_PDL=0 in the environment, or `dependent_launches(False)`, turns it off. Measured: 6.5% of the 32-layer
fp8_row step's GPU time at B1 (docs/decisions/0018-programmatic-dependent-launch.md).
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability
from fxquant.kernels.launch import inlined, next_power_of_2

LINE_BYTES = 128  # what one L2 prefetch asks for
# Weight lines a row a GEMM program asks L2 for before its wait: 8 K steps of fp8 (1 KB a row). At decode that is the
# whole slice of the 4096x4096 and merged q/k/v weights, and 8-16 MB of the larger ones, within the H200's 50 MB L2.
PREFETCH_LINES = 8
ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}
_enabled = [os.environ.get("FXQUANT_PDL", "1") != "0"]
_prefetch = [os.environ.get("FXQUANT_PREFETCH", "1") != "0"]


def launch_options(device: torch.device) -> dict:
    """The PDL constexpr, and the launch option where it is on: a GPU of sm_90 or later, and kernels not inlined
    for tracing (Inductor's launcher would take the option for a kernel argument). Off on the CPU's interpreter."""
    if _enabled[0] and device.type == "cuda" and not inlined() and capability(device) >= (9, 0):
        return ON
    return OFF


def prefetch_steps(options: dict, lines: int) -> int:
    """`prefetch_lines`' LINES for a launch with these `launch_options` and `lines` lines of weight a row: a power of
    two covering min(lines, PREFETCH_LINES), or 0 where the kernel does not wait on a previous one or prefetch is
    off (FXQUANT_PREFETCH=0, `weight_prefetch(False)`)."""
    if not options["PDL"] or not _prefetch[0] or lines <= 0:
        return 0
    return min(PREFETCH_LINES, next_power_of_2(lines))


@contextlib.contextmanager
def weight_prefetch(enabled: bool):
    """GEMMs launched inside the block ask L2 for their first weight lines before they wait, or not."""
    before, _prefetch[0] = _prefetch[0], enabled
    try:
        yield
    finally:
        _prefetch[0] = before


@contextlib.contextmanager
def dependent_launches(enabled: bool):
    """Launches inside the block use programmatic dependent launch or not; a CUDA graph keeps what its capture saw."""
    before, _enabled[0] = _enabled[0], enabled
    try:
        yield
    finally:
        _enabled[0] = before


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A kernel's first statement: where launched dependent, wait for the previous kernel's writes, then let the
    next kernel start launching (it waits in turn, so starting it early is safe)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_lines(base_ptr, row_ptrs, row_ok, lines, LINES: tl.constexpr, LINE_ELEMENTS: tl.constexpr):
    """Ask L2 for the first min(lines, LINES) 128-byte lines (LINE_ELEMENTS elements each) from each row pointer
    where row_ok: weight bytes a program will read, fetched while it waits on the previous kernel. Lines outside
    are asked at base_ptr, in bounds. On the GPU only (inline PTX); callers gate it on PDL, off in the interpreter."""
    offs = tl.arange(0, LINES)
    ok = row_ok[:, None] & (offs < lines)[None, :]
    ptrs = tl.where(ok, row_ptrs[:, None] + offs[None, :] * LINE_ELEMENTS, base_ptr)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)
