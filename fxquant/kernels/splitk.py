"""Split-K where the output tiles are too few for the SMs: the K loop is cut into SPLIT_K slices run by separate
programs, each writing an fp32 partial; one reduce kernel sums them in a fixed order (deterministic, unlike
atomics), adds the bias and casts.

At decode (M <= 16), and at medium M where the tile configs ask for it, a GEMM's time is mostly weight bytes /
bandwidth, and an N-only grid of 32-64 tiles leaves most of the 132 SMs idle; cutting K gives every SM a slice of
the weight to stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, float_cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import cdiv, visible

TARGET_PROGRAMS = 264  # two programs per SM of an H200 (132 SMs) keep loads in flight while one waits


def split_k(tiles: int, k_steps: int, programs: int = TARGET_PROGRAMS) -> int:
    """Slices of K for a grid of `tiles` output tiles and `k_steps` BLOCK_K steps, aiming at `programs` programs."""
    if tiles >= programs:
        return 1
    split = 1
    while tiles * split * 2 <= programs and k_steps // (split * 2) >= 4:  # keep >= 4 K steps per slice
        split *= 2
    return split


@triton.jit
def _splitk_reduce_kernel(
    # pointers
    ws_ptr, c_ptr, bias_ptr,
    # sizes and strides
    M, N, stride_cm, stride_cn,
    # meta-parameters
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits on every run; unrolled, all loads in flight
        acc += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
    m, n = offs // N, offs % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + m * stride_cm + n * stride_cn, cast_float(acc, OUT, CAST), mask=mask)


def reduce_partials(ws: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, out_tl) -> torch.Tensor:
    """out = sum(ws [SPLIT_K, M, N], 0) + bias, cast once to out's dtype."""
    split, M, N = ws.shape
    # 256 outputs on 2 warps, one 16-byte load per thread per slice: at decode's M = 1 the reduce spreads over
    # N / 256 programs. Against 1024 on 4 warps with a rolled loop it took 1.2 against 1.9 us after a 4096x4096 int4
    # GEMM split 8, and 1.4 against 2.6 after 4096x14336 split 14 (docs/decisions/0009-int4-split-and-reduce.md).
    block = 256
    visible(_splitk_reduce_kernel)[(cdiv(M * N, block),)](
        ws, out, bias if bias is not None else ws, M, N, out.stride(0), out.stride(1),
        SPLIT_K=split, HAS_BIAS=bias is not None, OUT=out_tl, CAST=float_cast_mode(_splitk_reduce_kernel),
        BLOCK=block, num_warps=2, **launch_options(out.device),
    )
    return out
