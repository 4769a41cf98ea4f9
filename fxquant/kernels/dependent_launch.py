"""Programmatic dependent launch (sm_90+): a kernel starts while the one before it in the stream finishes.

A kernel launched with `launch_pdl` may have its programs resident while the previous kernel's last programs still
run. Each of its programs first waits (griddepcontrol.wait) until that kernel has finished and its writes are
visible, then lets the next kernel begin its own launch. Between the dozen dependent kernels of a decode layer this
hides the launch and tail each one otherwise waits for; stream capture keeps the edges, so CUDA graphs keep it.

The wait comes before any load or store, so every result is the serial launch's, bit for bit. The fp8 decode GEMM
first asks the L2 for its first weights, which no kernel writes (`prefetch_l2`, a hint), so that the fetch overlaps
the previous kernel's end; the 4-bit decode GEMMs can, and do not by default (`weights_prefetched`): in the 32-layer
step on the H100 the fp8 GEMM's prefetch took 0.10 / 0.20 ms of GPU time a step at B1 / B16 (3.816 -> 3.713, 4.939
-> 4.740, step less host) and int4's added 0.10 (docs/decisions/0030-fp8-decode-weights-prefetched.md).
Decode attention lets the next kernel launch only after its key loop, and the fp8 and int4 mma.sync GEMMs after their
K loop: a next kernel as large as itself, resident early and waiting, took the slots its own programs needed
(docs/decisions/0021-decode-attention-merged-by-the-last-split.md,
docs/decisions/0028-int4-mma-next-kernel-after-the-k-loop.md). After a
kernel launched without it (Inductor's, cuBLAS's), a kernel launched with it starts when that one ends, as before.
FXQUANT_PDL=0 in the environment, or `dependent_launches(False)`, turns it off, for Inductor's kernels too: while it is
on, the backend compiles them launched dependent (Inductor's `triton.enable_pdl`), so that a decode GEMM after an
Inductor kernel (a norm, SiLU x up) starts while that one ends
(docs/decisions/0032-inductor-kernels-launched-dependent.md). Measured: 6.5% of the 32-layer fp8_row step's GPU time
at B1 (docs/decisions/0018-programmatic-dependent-launch.md); Inductor's, 0.14 / 0.19 ms of int4_wo's at B1 / B16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability
from fxquant.kernels.launch import inlined, set_inside

ON = {"PDL": True, "launch_pdl": True}
OFF = {"PDL": False}
_enabled = [os.environ.get("FXQUANT_PDL", "1") != "0"]
_prefetch = [None]  # `weights_prefetched`: None, each kernel's default
PREFETCH_STEPS = tl.constexpr(4)  # K steps of a program's weights asked of the L2 before the wait


def launch_options(device: torch.device) -> dict:
    """The PDL constexpr, and the launch option where it is on: a GPU of sm_90 or later, and kernels not inlined
    for tracing (Inductor's launcher would take the option for a kernel argument). Off on the CPU's interpreter."""
    if _enabled[0] and device.type == "cuda" and not inlined() and capability(device) >= (9, 0):
        return ON
    return OFF


def dependent_launches(enabled: bool):
    """Launches inside the block use programmatic dependent launch or not; a CUDA graph keeps what its capture saw."""
    return set_inside(_enabled, enabled)


def launching_dependent() -> bool:
    """What `dependent_launches` (or FXQUANT_PDL) set: whether launches now use it where the GPU has it. The backend
    reads it when it compiles, for Inductor's kernels (`triton.enable_pdl`)."""
    return _enabled[0]


def weights_prefetched(enabled: bool | None):
    """The decode GEMMs launched inside the block (the fp8 GEMM, the int4 mma.sync kernel over tiles, the in-register
    weight-only GEMM over packed 4-bit codes) ask the L2 for their first PREFETCH_STEPS K steps of weights before
    they wait for the previous kernel (True), or none does (False); None, the default: each kernel's own default
    (`prefetching`), the fp8 GEMM's on and the 4-bit GEMMs' off."""
    return set_inside(_prefetch, enabled)


def prefetching(options: dict, by_default: bool = False) -> bool:
    """Whether a kernel launched with `launch_options` `options` prefetches: under `weights_prefetched`, or its own
    default `by_default` outside it; only a kernel launched dependent waits, so only it prefetches."""
    chosen = by_default if _prefetch[0] is None else _prefetch[0]
    return chosen and bool(options["PDL"])


@triton.jit
def steps_ahead(first, last):
    """The K steps a program asks the L2 for: its first PREFETCH_STEPS from `first`, none past its last (last - 1;
    step 0 for an empty slice)."""
    return tl.minimum(first + tl.arange(0, PREFETCH_STEPS), tl.maximum(last - 1, 0))


@triton.jit
def prefetch_l2(lines):
    """Ask the L2 for the 128-byte lines at the pointers `lines`: a hint, with no value and no wait, so it changes
    no result."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """A kernel's first statement: where launched dependent, wait for the previous kernel's writes, then let the
    next kernel start launching (it waits in turn, so starting it early is safe)."""
    await_previous(PDL)
    start_next(PDL)


@triton.jit
def await_previous(PDL: tl.constexpr):
    """The wait alone, for a kernel that lets the next one launch later (`start_next`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_next(PDL: tl.constexpr):
    """Let the next kernel launch: its programs take SM slots from here on, waiting for this kernel to end."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
