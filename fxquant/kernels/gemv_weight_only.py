"""Weight-only products for the smallest batches (M <= GEMV_MAX_M) on CUDA cores: out[M, N] = A @ dequantize(W).T.

An MMA at M = 1 wastes 15 of its 16 rows, and every decoded weight must reach its operand layout through shared
memory. Here each code is decoded in the thread that loaded it and multiplied there by the M activations, so the
work per code is a few integer and float instructions, and the kernel streams the weight. Each M row costs one
FMA per code, which is why the tensor-core kernel takes over past GEMV_MAX_M.

Codes become exact fp32 values from bits, as in the tensor-core kernel (`codes.py`):
- int8: (c ^ 0x80) is c + 128, ORed into 2^23's mantissa, minus 2^23 + 128; the channel scale in the epilogue;
- int4: q - z as the difference of two biased integers; the group's fp32 scale multiplies its partial sum;
- MXFP4 / NVFP4: the e2m1 value times its block scale, exact in fp32 (at most 6 significant bits), so the
  products need no per-block sums; NVFP4's fp32 global scale in the epilogue.
Sums are fp32. K splits across programs (`splitk.py`); K and N tails are masked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import float_cast_mode
from fxquant.kernels.codes import FORMATS, biased, block_scale, e2m1_value, nibbles
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, next_power_of_2
from fxquant.kernels.splitk import reduce_partials, split_k
from fxquant.kernels.tiles import k_steps_of, store_tile


@triton.jit
def _wo_gemv_kernel(
    # pointers
    a_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, c_ptr, ws_ptr, bias_ptr,
    # sizes
    M, N, K,
    # strides (the weight's in its own elements: bytes for int8, int32 words of packed codes for 4-bit)
    stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk, stride_cm, stride_cn,
    # meta-parameters
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    OUT: tl.constexpr, CAST: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_k, last_k):
        k = step * BLOCK_K + offs_k
        a_mask = mask_m[:, None] if EVEN_K else mask_m[:, None] & (k[None, :] < K)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak, mask=a_mask,
                    other=0.0).to(tl.float32)  # [BM, BK]; masked K is zero, so masked codes add nothing
        if FMT == 0:
            w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                        mask=mask_n[:, None] & (k[None, :] < K), other=0)
            # int8 c is (c ^ 0x80) - 128 with c ^ 0x80 in [0, 255]: biased integers, no int -> float conversion
            values = biased((w.to(tl.int32) & 0xFF) ^ 0x80) - biased(tl.full((1, 1), 128, tl.int32))
            acc += tl.sum(a[:, None, :] * values[None, :, :], axis=2)
        elif FMT == 1:
            codes = nibbles(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K, EVEN_K)
            GROUPS: tl.constexpr = BLOCK_K // GROUP  # int4 groups per K step (BLOCK_K is a multiple of GROUP)
            offs_g = step * GROUPS + tl.arange(0, GROUPS)
            g_mask = mask_n[:, None] & (offs_g[None, :] * GROUP < K)
            scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk, mask=g_mask,
                            other=0.0)  # [BN, GROUPS]
            if HAS_ZP:
                z = tl.load(z_ptr + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk, mask=g_mask,
                            other=0).to(tl.int32)
            else:  # a symmetric code c is (c ^ 8) - 8
                codes = codes ^ 8
                z = tl.full((BLOCK_N, GROUPS), 8, tl.int32)
            ints = tl.reshape(biased(codes), (BLOCK_N, GROUPS, GROUP)) - biased(z)[:, :, None]  # q - z, exact
            a3 = tl.reshape(a, (BLOCK_M, GROUPS, GROUP))
            # Each group's exact-integer sum is scaled once, as the tensor-core kernel scales its K step's sum.
            sums = tl.sum(a3[:, None, :, :] * ints[None, :, :, :], axis=3)  # [BM, BN, GROUPS]
            acc += tl.sum(sums * scale[None, :, :], axis=2)
        else:
            codes = nibbles(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K, EVEN_K)
            BLOCKS: tl.constexpr = BLOCK_K // GROUP  # scale blocks per K step (BLOCK_K is a multiple of 16, 32)
            offs_b = step * BLOCKS + tl.arange(0, BLOCKS)
            scale = block_scale(s_ptr, offs_n[:, None], offs_b[None, :], stride_sn, stride_sk,
                                mask_n[:, None] & (offs_b[None, :] * GROUP < K), FMT)  # [BN, BLOCKS]
            values = tl.reshape(tl.reshape(e2m1_value(codes), (BLOCK_N, BLOCKS, GROUP)) * scale[:, :, None],
                                (BLOCK_N, BLOCK_K))  # exact: e2m1 times a power of two or an e4m3 scale
            acc += tl.sum(a[:, None, :] * values[None, :, :], axis=2)
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if FMT == 3:
        acc = acc * tl.load(gs_ptr)
    store_tile(acc, c_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, pid_k,
               HAS_BIAS, SPLIT_K, OUT, CAST)


GEMV_MAX_M = 4  # past this many rows, the tensor-core kernel is faster (BENCHMARKS.md, eighth round)


def wo_gemv_config(fmt: str) -> dict:
    """Tiles for the GEMV: the winners of `bench/weight_only.py --gemv` on an H200 (BENCHMARKS.md). A scale group
    wider than BLOCK_K widens the K step to it."""
    return dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3, programs=1056)


@functools.lru_cache(maxsize=1024)
def _launch_plan(M: int, N: int, K: int, group: int, config: tuple):
    """(N tiles, K slices, meta-parameters) of the GEMV at a shape, worked out once."""
    cfg = dict(config)
    block_k = max(cfg["BLOCK_K"], group)  # whole scale groups per K step (both are powers of two)
    tiles = cdiv(N, cfg["BLOCK_N"])
    split = split_k(tiles, cdiv(K, block_k), cfg["programs"])
    meta = dict(EVEN_K=K % block_k == 0, BLOCK_M=next_power_of_2(M), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return tiles, split, meta


def weight_only_gemv(a, codes, scale, fmt: str, group: int, N: int, zero_point, global_scale, bias, config=None):
    """a [M, K] (M <= GEMV_MAX_M, or any M given a `config`) times the [N, K] weight as `weight_only_mm` passes it:
    int8 codes [N, K] or packed 4-bit rows as int32 words [N, K/8], and scales [N, -1] (uint8 codes for MXFP4,
    NVFP4). Returns [M, N] in a's dtype."""
    M, K = a.shape
    cfg = tuple(sorted((config or wo_gemv_config(fmt)).items()))
    tiles, split, meta = _launch_plan(M, N, K, group, cfg)
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    _wo_gemv_kernel[(tiles, split)](
        a, codes, scale, zero_point if zero_point is not None else scale,
        global_scale if global_scale is not None else scale, out, ws, bias if bias is not None else out,
        M, N, K,
        a.stride(0), a.stride(1), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        FMT=FORMATS[fmt], GROUP=group or 1, HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None,
        SPLIT_K=split, OUT=TORCH_TO_TL[a.dtype], CAST=float_cast_mode(_wo_gemv_kernel), **meta,
    )
    if split > 1:
        reduce_partials(ws, out, bias, TORCH_TO_TL[a.dtype])
    return out
