"""The per-token quantizer in the fp8 decode GEMM's prologue, a probe of what a layer's row kernels cost at small
batch: in the chain of fp8_row decode layers of `bench.layer_chain`, the q/k/v and gate/up products quantize their
bf16 input themselves, in place of the quantize kernel before each: two kernels fewer a layer (attention quantizes
its own output already; SiLU x up and its quantizer stay a kernel).

Every program of the GEMM reads the whole rows it multiplies (8 KB a token at 4096 columns, from the L2) for their
amax, in chunks whose maximum is exact in any order, then quantizes its own K slice in registers before each MMA:
the scale (max(amax, floor) / 448, an IEEE division), the reciprocal, the saturation and the cast are
`quant_fp8.quant_rows`' own, so the codes, the products and the chain are the two kernels' bits (checked first; also
`bench/tests/test_bench_quant_prologue.py` under the interpreter). The residual add and RMSNorm the product's kernel
runs beside the quantizer are not in either chain: the probe times the launch boundary, not the norm.

Run: python -m bench.quant_prologue [--layers 32] [--batches 1 4 16] [--context 1024]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.layer_chain import arguments, chain, same_bits, time_variants
from fxquant.kernels.cast import CAST_NATIVE, cast_fp8, cast_mode, float_cast_mode
from fxquant.kernels.dependent_launch import (
    await_previous,
    launch_options,
    prefetch_l2,
    prefetching,
    start_next,
    steps_ahead,
)
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL, _launch_plan
from fxquant.kernels.quant_fp8 import max_keep_nan, saturate
from fxquant.kernels.splitk import counters, reduce_partials, sum_if_last_slice
from fxquant.kernels.tiles import k_steps_of, store_tile
from fxquant.numerics.formats import AMAX_FLOOR, E4M3

# Columns of the rows read at once for their amax: one K step's, so the row scale's layout is the K loop's tile's.
# 512 gave the quantizer a layout that holds the 16 x 128 step four times over: 444 SASS instructions a K step
# against 257 (sm_90, Triton 3.8).
AMAX_CHUNK = 128
NATIVE = tl.constexpr(CAST_NATIVE)


@triton.jit
def _quant_prologue_gemm_kernel(x_ptr, b_ptr, c_ptr, ws_ptr, b_scale_ptr, counter_ptr, M, N, K, stride_xm,
                                stride_bn, stride_cm, FMAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
                                QCAST: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, ROW: tl.constexpr,
                                CHUNK: tl.constexpr, SPLIT_K: tl.constexpr, LAST_SLICE_SUMS: tl.constexpr,
                                BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                                PREFETCH: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    if PREFETCH:  # the fp8 GEMM's own prefetch: no kernel writes the weight
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        prefetch_l2(b_ptr + rows[:, None] * stride_bn + (steps_ahead(first_k, last_k) * BLOCK_K)[None, :])
    await_previous(PDL)
    mask_m = offs_m < M
    # The amax of each whole row: a maximum, exact in any order, so the quantize kernel's bits.
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c in tl.static_range(ROW // CHUNK):
        cols = c * CHUNK + tl.arange(0, CHUNK)
        part = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                       mask=mask_m[:, None] & (cols[None, :] < K), other=0.0).to(tl.float32)
        amax = max_keep_nan(amax, tl.reduce(tl.abs(part), 1, max_keep_nan))
    # quant_rows' fp32 ops: max(amax, floor) / FMAX (IEEE division), a NaN scale for a poisoned row
    scale = tl.where(amax < float("inf"), tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FMAX), float("nan"))
    inverse = tl.math.div_rn(1.0, scale)

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_m[:, None] * stride_xm + (first_k * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + (first_k * BLOCK_K + offs_k)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_k, last_k):
        k_left = K - k * BLOCK_K
        x = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0).to(tl.float32)
        q = x * inverse[:, None]
        if QCAST != NATIVE:  # the native cast saturates to finite itself (cvt .satfinite; NaN stays NaN)
            q = saturate(q, FMAX)
        a = cast_fp8(q, tl.float8e4nv, QCAST)
        b = tl.load(b_ptrs, mask=(offs_n < N)[None, :] & (offs_k[:, None] < k_left), other=0.0)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)  # the fp8 GEMM's promotion every BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    start_next(PDL)
    b_s = tl.load(b_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    acc = acc * scale[:, None] * b_s[None, :]  # fp8_scale_tile's order
    store_tile(acc, c_ptr, ws_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, 1, pid_k, False, SPLIT_K, OUT, CAST)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, c_ptr, c_ptr, counter_ptr, pid_n, offs_m, offs_n, M, N, stride_cm, 1, False,
                          SPLIT_K, OUT, CAST)


def quant_prologue_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """quantize_fp8_rows(x, K) then fp8_scaled_mm(.., w, w_scale) into bf16, in one kernel: x [M <= 16, K] bf16
    (K a multiple of AMAX_CHUNK), w [N, K] e4m3 codes, w_scale [N, 1] per channel. The fp8 GEMM's tiles and split."""
    M, K = x.shape
    N = w.shape[0]
    tiles, split, _, meta = _launch_plan(M, N, K, False, False, ())
    if meta["BLOCK_M"] < M or K % AMAX_CHUNK:
        raise ValueError(f"quant_prologue_mm: M = {M} past a decode tile or K = {K} not in {AMAX_CHUNK}s")
    out = torch.empty((M, N), device=x.device, dtype=torch.bfloat16)
    ws = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else out
    count = counters(x.device, tiles) if split > 1 else None
    pdl = launch_options(x.device)
    _quant_prologue_gemm_kernel[(tiles, split)](
        x, w, out, ws, w_scale, count if count is not None else ws, M, N, K, x.stride(0), w.stride(0),
        out.stride(0), FMAX=E4M3.max, AMAX_FLOOR=AMAX_FLOOR, QCAST=cast_mode(_quant_prologue_gemm_kernel, x.device),
        OUT=TORCH_TO_TL[torch.bfloat16], CAST=float_cast_mode(_quant_prologue_gemm_kernel), ROW=K, CHUNK=AMAX_CHUNK,
        SPLIT_K=split, LAST_SLICE_SUMS=count is not None, BLOCK_M=meta["BLOCK_M"],
        BLOCK_N=meta["BLOCK_N"], BLOCK_K=meta["BLOCK_K"], num_warps=meta["num_warps"],
        num_stages=meta["num_stages"], PREFETCH=prefetching(pdl, by_default=True), **pdl)
    if split > 1 and count is None:
        reduce_partials(ws, out, None, TORCH_TO_TL[torch.bfloat16])
    return out


def main() -> None:
    parser = arguments(__doc__)
    parser.set_defaults(batches=[1, 4, 16])
    args = parser.parse_args()
    time_variants(args, {"quantize kernels": lambda s: chain(s["h"], s["layers"], s["kv"]),
                         "quantizer in the GEMM": lambda s: chain(s["h"], s["layers"], s["kv"],
                                                                  quant_gemm=quant_prologue_mm)}, same_bits)


if __name__ == "__main__":
    main()
