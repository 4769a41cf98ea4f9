"""A gated MLP at decode in two fp8 GEMMs: the merged gate/up product with silu(gate) * up in its epilogue, tile by
tile, and the down product quantizing that activation per token as it reads it.

    down(quantize_fp8_rows(silu(gate) * up)), [gate | up] = x @ W_gu.T

runs in three kernels elsewhere (the gate/up GEMM, `silu_mul_quant`, the down GEMM). Here:
- the gate/up GEMM gives each program BLOCK_N / 2 gate rows and the same up rows of the merged weight, so a tile
  holds both halves of its outputs: it stores silu(gate) * up in the activations' dtype and its rows' amax over its
  columns ([tiles, M] fp32, NaN and inf as inf);
- each program of the down GEMM takes the max of those partial amaxes for its rows, makes the row scale as
  `quant_fp8.quant_rows` makes it, and quantizes each [BLOCK_M, BLOCK_K] step of the activation before its MMA.
The gate/up sums, silu(gate) * up, the row scales and the codes are the three kernels' values bit for bit, so the
output is theirs. Unlike the row work taken out of the GEMM epilogue before
(docs/decisions/0027-row-work-stays-in-its-own-kernels.md), no program runs a row alone: the product is made by
every tile of the gate/up GEMM, and the quantization by every program of the down GEMM over its own K slice.

Each step's codes are made once a program (`tiles.codes_made_once`), not once a warp in the MMA operand's layout,
which took 493 SASS instructions a K step against the fp8 GEMM's 154 (260 now; `python -m bench.sass gated`).

No pass writes it yet: `bench.gated_mlp` times it in the 32-layer chain of a decode layer's kernels, against the
three kernels, and checks that chain's bits equal. The pass and op that put it in the pipeline (`fuse_gated_mlp`,
`fxquant::gated_mlp_fp8`, one op for the three) were built and tested on the CPU at a989eb9 and taken out untimed:
a fusion goes in once it wins in the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import CAST_NATIVE, cast_float, cast_fp8, cast_mode
from fxquant.kernels.dependent_launch import await_previous, launch_options, prefetching, start_next
from fxquant.kernels.gemm_fp8 import (
    TORCH_TO_TL,
    _launch_plan,
    fp8_accumulate,
    fp8_scale_tile,
    prefetch_weight_steps,
)
from fxquant.kernels.launch import cdiv, next_power_of_2, visible
from fxquant.kernels.quant_fp8 import saturate
from fxquant.kernels.silu_mul_quant import silu_mul
from fxquant.kernels.splitk import counters, reduce_partials, sum_if_last_slice
from fxquant.kernels.tiles import codes_made_once, k_steps_of, store_tile, tile_offsets
from fxquant.numerics.formats import AMAX_FLOOR, E4M3

NATIVE = tl.constexpr(CAST_NATIVE)
# Partial amaxes the down GEMM reads at once: at 512 its K loop held 128 registers a thread, at 128 88 (sm_90).
PARTS_AT_ONCE = 128


@triton.jit
def _gate_up_silu_kernel(
    # pointers
    a_ptr, b_ptr, h_ptr, amax_ptr, a_scale_ptr, b_scale_ptr,
    # sizes: M tokens, inter = the intermediate width (the merged weight has 2 * inter rows), K
    M, inter, K,
    # strides
    stride_am, stride_ak, stride_bn, stride_bk, stride_hm, stride_asm, stride_bsn,
    # meta-parameters
    OUT: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Tile (pid_m, pid_n) multiplies gate rows and up rows [pid_n * HALF, (pid_n + 1) * HALF) of the merged weight,
    stores h = silu(gate) * up at those columns, and its rows' amax at amax[pid_n, rows]."""
    HALF: tl.constexpr = BLOCK_N // 2
    if not PREFETCH:
        await_previous(PDL)
    pid_m, pid_n, offs_m, cols = tile_offsets(tl.program_id(0), M, inter, BLOCK_M, HALF, GROUP_M)
    j = tl.arange(0, BLOCK_N)
    columns = pid_n * HALF + j % HALF
    offs_n = tl.where(j < HALF, columns, inter + columns)  # the first HALF of the tile gate, the second up
    offs_n = tl.where(columns < inter, offs_n, 2 * inter)  # past the last column: masked as past N
    first_k, last_k = k_steps_of(0, K, BLOCK_K, 1)
    if PREFETCH:  # no kernel writes the weight: the L2 fetches its first K steps while the previous kernel ends
        prefetch_weight_steps(b_ptr, offs_n, 2 * inter, stride_bn, stride_bk, first_k, last_k, BLOCK_K)
        await_previous(PDL)
    acc = fp8_accumulate(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, offs_m, offs_n, pid_n, M, 2 * inter, K, first_k,
                         last_k, stride_am, stride_ak, stride_bn, stride_bk, stride_asm, 0, stride_bsn, 0,
                         False, 128, True, BLOCK_M, BLOCK_N, BLOCK_K, False, b_ptr, False)
    start_next(PDL)
    acc = fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr, offs_m, offs_n, M, 2 * inter, stride_asm, stride_bsn, False)
    # The merged product as the unfused GEMM stores it (rounded once to OUT), its halves side by side.
    stored = cast_float(acc, OUT, CAST).to(tl.float32)
    gate, up = tl.split(tl.permute(tl.reshape(stored, (BLOCK_M, 2, HALF)), (0, 2, 1)))
    h = silu_mul(gate, up, OUT, CAST)
    mask = (offs_m < M)[:, None] & (cols < inter)[None, :]
    tl.store(h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + cols[None, :], h.to(OUT), mask=mask)
    # NaN and inf both poison a row's scale (quant_rows): either reads as inf, which the max keeps.
    magnitude = tl.where(mask & (h == h), tl.abs(h), tl.where(mask, float("inf"), 0.0))
    tl.store(amax_ptr + pid_n * M + offs_m, tl.max(magnitude, axis=1), mask=offs_m < M)


@triton.jit
def _down_quantized_kernel(
    # pointers
    h_ptr, amax_ptr, b_ptr, c_ptr, ws_ptr, b_scale_ptr, counter_ptr,
    # sizes: M tokens, N outputs, K = the intermediate width, and the amax partials a row
    M, N, K, parts,
    # strides
    stride_hm, stride_bn, stride_bk, stride_cm, stride_cn, stride_bsn,
    # meta-parameters
    FMAX: tl.constexpr, FP8: tl.constexpr, AMAX_FLOOR: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr,
    SPLIT_K: tl.constexpr, LAST_SLICE_SUMS: tl.constexpr, BLOCK_PARTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """y = quantize_fp8_rows(h) @ W.T with W's row scales: h's row scales from the partial amaxes, each K step of h
    quantized before its MMA."""
    if not PREFETCH:
        await_previous(PDL)
    pid_k = tl.program_id(1)
    pid_m, pid_n, offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    if PREFETCH:
        prefetch_weight_steps(b_ptr, offs_n, N, stride_bn, stride_bk, first_k, last_k, BLOCK_K)
        await_previous(PDL)
    mask_m, mask_n = offs_m < M, offs_n < N
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, parts, BLOCK_PARTS):
        p = start + tl.arange(0, BLOCK_PARTS)
        partial = tl.load(amax_ptr + p[:, None] * M + offs_m[None, :], mask=(p < parts)[:, None] & mask_m[None, :],
                          other=0.0)
        amax = tl.maximum(amax, tl.max(partial, axis=0))
    # quant_rows' fp32 ops: max(amax, floor) / FMAX (IEEE division), a NaN scale for a poisoned row, one reciprocal.
    scale = tl.where(amax < float("inf"), tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FMAX), float("nan"))
    inverse = tl.math.div_rn(1.0, scale)
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + offs_m[:, None].to(tl.int64) * stride_hm + (first_k * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + (first_k * BLOCK_K + offs_k)[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_k, last_k):
        k_left = K - k * BLOCK_K
        h = tl.load(h_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0).to(tl.float32)
        # quant_rows' codes: times the row's reciprocal, saturated (NaN kept), cast by the shared bit-exact helper;
        # the native cast saturates to finite itself (cvt .satfinite; NaN stays NaN). Made once a program, not once
        # a warp (codes_made_once).
        q = h * inverse[:, None]
        if CAST != NATIVE:
            q = saturate(q, FMAX)
        codes = codes_made_once(cast_fp8(q, FP8, CAST), CAST)
        b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        # As the fp8 GEMM: the compiler adds each BLOCK_K step's partial into fp32.
        acc = tl.dot(codes, b, acc, max_num_imprecise_acc=BLOCK_K)
        h_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    start_next(PDL)
    b_s = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=mask_n, other=0.0)
    acc = acc * scale[:, None] * b_s[None, :]  # fp8_scale_tile's order: the token's scale, then the channel's
    store_tile(acc, c_ptr, ws_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, pid_k, False, SPLIT_K, OUT,
               CAST)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, c_ptr, c_ptr, counter_ptr, tl.program_id(0), offs_m, offs_n, M, N, stride_cm,
                          stride_cn, False, SPLIT_K, OUT, CAST)


def silu_mul_rows_fp8(a, a_scale, w_gu, s_gu, out_dtype=torch.bfloat16, config=None):
    """The gate/up GEMM's half: (h = silu(gate) * up [M, I] in out_dtype, partial amaxes [tiles, M] fp32), where
    [gate | up] = fp8_scaled_mm(a, a_scale, w_gu, s_gu) with row scales (a_scale [M, 1], s_gu [2I, 1])."""
    M, K = a.shape
    inter = w_gu.shape[0] // 2
    _, _, _, meta = _launch_plan(M, 2 * inter, K, False, False, tuple(sorted((config or {}).items())))
    half = meta["BLOCK_N"] // 2
    tiles_n = cdiv(inter, half)
    h = torch.empty((M, inter), dtype=out_dtype, device=a.device)
    amax = torch.empty((tiles_n, M), dtype=torch.float32, device=a.device)
    pdl = launch_options(a.device)
    visible(_gate_up_silu_kernel)[(cdiv(M, meta["BLOCK_M"]) * tiles_n,)](
        a, w_gu, h, amax, a_scale, s_gu, M, inter, K,
        a.stride(0), a.stride(1), w_gu.stride(0), w_gu.stride(1), h.stride(0), _row_stride(a_scale),
        _row_stride(s_gu), OUT=TORCH_TO_TL[out_dtype], CAST=cast_mode(_gate_up_silu_kernel, a.device),
        BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"], BLOCK_K=meta["BLOCK_K"], GROUP_M=meta["GROUP_M"],
        num_warps=meta["num_warps"], num_stages=meta["num_stages"], PREFETCH=prefetching(pdl, by_default=True),
        **pdl,
    )
    return h, amax


def down_from_rows_fp8(h, amax, w_down, s_down, config=None):
    """fp8_scaled_mm(*quantize_fp8_rows(h, K), w_down, s_down) in h's dtype, h's row amax the max over amax's
    partials [parts, M]."""
    M, K = h.shape
    N = w_down.shape[0]
    tiles, split, _, meta = _launch_plan(M, N, K, False, False, tuple(sorted((config or {}).items())))
    out = torch.empty((M, N), dtype=h.dtype, device=h.device)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=h.device) if split > 1 else out
    count = counters(h.device, tiles) if split > 1 else None
    pdl = launch_options(h.device)
    visible(_down_quantized_kernel)[(tiles, split)](
        h, amax, w_down, out, ws, s_down, count if count is not None else ws, M, N, K, amax.shape[0],
        h.stride(0), w_down.stride(0), w_down.stride(1), out.stride(0), out.stride(1), _row_stride(s_down),
        FMAX=E4M3.max, FP8=tl.float8e4nv, AMAX_FLOOR=AMAX_FLOOR, OUT=TORCH_TO_TL[h.dtype],
        CAST=cast_mode(_down_quantized_kernel, h.device),
        SPLIT_K=split, LAST_SLICE_SUMS=count is not None,
        BLOCK_PARTS=min(next_power_of_2(amax.shape[0]), PARTS_AT_ONCE),
        BLOCK_M=meta["BLOCK_M"], BLOCK_N=meta["BLOCK_N"], BLOCK_K=meta["BLOCK_K"], GROUP_M=meta["GROUP_M"],
        num_warps=meta["num_warps"], num_stages=meta["num_stages"], PREFETCH=prefetching(pdl, by_default=True),
        **pdl,
    )
    if split > 1 and count is None:
        reduce_partials(ws, out, None, TORCH_TO_TL[h.dtype])
    return out


def gated_mlp_fp8(a, a_scale, w_gu, s_gu, w_down, s_down, config_gu=None, config_down=None):
    """down(quantize_fp8_rows(silu(gate) * up)) for fp8 a [M, K] with per-token a_scale [M, 1], the merged gate/up
    weight w_gu [2I, K] and w_down [N, I] in e4m3 with per-channel scales; -> [M, N] bf16."""
    return down_from_rows_fp8(*silu_mul_rows_fp8(a, a_scale, w_gu, s_gu, config=config_gu), w_down, s_down,
                              config=config_down)


def _row_stride(scale: torch.Tensor) -> int:
    """A row scale's stride: 0 where one value serves every row."""
    return 0 if scale.numel() == 1 else scale.reshape(-1).stride(0)
