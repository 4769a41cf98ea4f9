"""Programmatic dependent launch (sm_90+), so that a decode GEMM starts reading its weight before its input exists.

A kernel launched with `launch_pdl` may start while the kernel before it in the stream still runs, once every
program of that kernel has called `let_dependents_launch` (or exited). It must call `wait_for_inputs` before it
reads anything that kernel writes: the wait returns when the previous grid has completed and its writes are visible.

fxquant's GEMMs use the time before the wait to ask L2 for the first K steps of their weight slices
(`prefetch_rows`): no kernel writes a weight, so the weight stream starts during the quantizer, norm or split-K
reduce before the GEMM, instead of after it. The quantizers and the norm let their dependents launch as soon as they
start; the GEMMs and the reduce do so once their own inputs are ready, so a chain runs at most one kernel ahead.
A kernel that was not launched this way (Inductor's, cuBLAS) is ordered as usual, and the wait after it is a no-op.
Off sm_90 and under the interpreter, which lack these instructions, kernels launch as usual.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from fxquant.kernels.cast import capability, interpreting

ENABLED = True  # off inside `disabled()`, which the benchmarks use to measure what the overlap brings
MAX_RESIDENT_PER_SM = 8  # decode tiles are small: up to 8 programs share an SM


def pdl_options(kernel, device: torch.device) -> dict:
    """The PDL constexpr and launch option for launching `kernel` on `device`."""
    on = ENABLED and not interpreting(kernel) and device.type == "cuda" and capability(device) >= (9, 0)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@contextlib.contextmanager
def disabled():
    """Kernels launched inside the block launch as usual: to measure or check what the overlap changes."""
    global ENABLED
    before, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = before


def prefetch_steps(programs: int, step_bytes: int, sms: int, l2_bytes: int) -> int:
    """K steps of its weight slice each GEMM program prefetches. The programs that can run at once share half of
    the L2, so the prefetched lines are still there when the K loop reads them. At least one step, the first,
    which every program reads right after the wait."""
    return max(1, l2_bytes // 2 // (min(programs, MAX_RESIDENT_PER_SM * sms) * step_bytes))


def prefetchable(weight: torch.Tensor) -> bool:
    """The bulk L2 prefetch reads 16-byte-aligned runs: rows contiguous along K, 16-byte aligned."""
    return weight.stride(-1) == 1 and weight.stride(0) * weight.element_size() % 16 == 0 \
        and weight.data_ptr() % 16 == 0


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Block until the previous grid has completed and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def let_dependents_launch(PDL: tl.constexpr):
    """Let the next kernel in the stream launch (it still waits for this one before reading its output)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_rows(ptr, rows, mask, row_bytes, first_byte, nbytes, PDL: tl.constexpr):
    """Ask L2 for `nbytes` bytes of each masked row of the weight at `ptr`, from byte `first_byte` of the row.
    The bulk prefetch moves whole 16-byte units, so a tail under 16 bytes is left to the loads; it is a hint,
    and the loads after the wait read the same bytes whatever it did."""
    if PDL:
        addr = ptr.to(tl.pointer_type(tl.int8)) + rows.to(tl.int64) * row_bytes + first_byte
        size = tl.where(mask & (nbytes >= 16), nbytes & ~15, 0).to(tl.int32)  # an empty K slice asks for nothing
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
            "=r,l,r", [addr.to(tl.int64), size], dtype=tl.int32, is_pure=False, pack=1,
        )
