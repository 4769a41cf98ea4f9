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
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv
from fxquant.kernels.splitk import reduce_partials, split_k
from fxquant.kernels.tiles import k_steps_of, store_tile

NIBBLE_SIGNS = tl.constexpr(-0x77777778)  # 0x88888888 as an int32: bit 3 of each of a word's 8 codes


@triton.jit
def _field(w, P: tl.constexpr):
    """2^23 + c * 2^(4P) as fp32, exactly, where c is the 4-bit field P of w (P <= 3, so it stays inside the 23
    mantissa bits): the field ORed in place into 2^23's mantissa, whose ulp is 1. One logic instruction pair, no
    shift, no int -> float conversion."""
    return ((w & (15 << 4 * P)) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _columns8(x, G: tl.constexpr, Q: tl.constexpr):
    """The 8 columns of x [G, Q, 4, 8] as tensors [G, Q, 4]: j = 4 * b2 + 2 * b1 + b0, split lowest bit first."""
    even, odd = tl.split(tl.reshape(x, (G, Q, 4, 4, 2)))
    c0, c2 = tl.split(tl.reshape(even, (G, Q, 4, 2, 2)))
    c1, c3 = tl.split(tl.reshape(odd, (G, Q, 4, 2, 2)))
    j0, j4 = tl.split(c0)
    j2, j6 = tl.split(c2)
    j1, j5 = tl.split(c1)
    j3, j7 = tl.split(c3)
    return j0, j1, j2, j3, j4, j5, j6, j7


@triton.jit
def _wo_gemv_kernel(
    # pointers
    a_ptr, w_ptr, s_ptr, z_ptr, c_ptr, ws_ptr, bias_ptr,
    # sizes
    N, K,
    # strides (the weight's in int32 words of 8 packed codes)
    stride_ak, stride_wn, stride_sn, stride_sk, stride_cn,
    # meta-parameters
    GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    OUT: tl.constexpr, CAST: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_k = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    GROUPS: tl.constexpr = BLOCK_K // GROUP  # int4 groups per K step
    QUARTERS: tl.constexpr = GROUP // 32  # 4-word (32-code) pieces of a group, each one 16-byte load per thread
    quarters = tl.arange(0, QUARTERS)
    words4 = tl.arange(0, 4)
    lanes8 = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_N, GROUPS), dtype=tl.float32)
    for step in range(first_k, last_k):
        offs_g = step * GROUPS + tl.arange(0, GROUPS)
        g_mask = mask_n[:, None] & (offs_g[None, :] * GROUP < K)
        scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk, mask=g_mask, other=0.0)
        if HAS_ZP:
            z = tl.load(z_ptr + offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sk, mask=g_mask,
                        other=0).to(tl.int32)
        else:  # a symmetric code c is (c ^ 8) - 8
            z = tl.full((BLOCK_N, GROUPS), 8, tl.int32)
        z = z[:, :, None, None]
        z0, z1, z2, z3 = _field(z, 0), _field(z << 4, 1), _field(z << 8, 2), _field(z << 12, 3)
        # The step's words and activations are loaded at once, so their latencies overlap. Each thread holds 4
        # words (32 codes) of a row; code field p of a half word sums, exactly scaled by 2^(4p), into part_p.
        word = (offs_g[:, None, None] * QUARTERS + quarters[None, :, None]) * 4 + words4[None, None, :]  # [G, Q, 4]
        lo = tl.load(w_ptr + offs_n[:, None, None, None].to(tl.int64) * stride_wn + word[None],
                     mask=g_mask[:, :, None, None], other=0)  # [BN, G, Q, 4]: codes 0-3 of a word, low half
        if not HAS_ZP:
            lo = lo ^ NIBBLE_SIGNS
        hi = lo >> 16  # codes 4-7 (the sign bits the shift brings in are masked off)
        k = word[:, :, :, None] * 8 + lanes8[None, None, None, :]  # [G, Q, 4, 8]
        a = tl.load(a_ptr + k * stride_ak, mask=k < K, other=0.0).to(tl.float32)  # masked K adds nothing
        a0, a1, a2, a3, a4, a5, a6, a7 = _columns8(a, GROUPS, QUARTERS)
        # (q - z) * 2^(4p) exactly, as the difference of two fields; one fp32 FMA per code
        part0 = (_field(lo, 0) - z0) * a0[None]
        part1 = (_field(lo, 1) - z1) * a1[None]
        part2 = (_field(lo, 2) - z2) * a2[None]
        part3 = (_field(lo, 3) - z3) * a3[None]
        part0 += (_field(hi, 0) - z0) * a4[None]
        part1 += (_field(hi, 1) - z1) * a5[None]
        part2 += (_field(hi, 2) - z2) * a6[None]
        part3 += (_field(hi, 3) - z3) * a7[None]
        part = part0 + part1 * 0.0625 + part2 * 0.00390625 + part3 * 0.000244140625  # times 2^-4p: exact
        part = tl.sum(tl.sum(part, axis=3), axis=2)
        acc += part * scale  # each group's sum scaled once, as the tensor-core kernel does
    out = tl.sum(acc, axis=1)
    store_tile(out[None, :], c_ptr, ws_ptr, bias_ptr, tl.arange(0, 1), offs_n, 1, N, 0, stride_cn, pid_k,
               HAS_BIAS, SPLIT_K, OUT, CAST)


def gemv_takes(M: int, fmt: str, group: int) -> bool:
    """Whether `weight_only_mm` runs the GEMV: one row of int4 in groups of at least 32 codes (whole 16-byte loads)."""
    return M == 1 and fmt == "int4" and group >= 32


def wo_gemv_config() -> dict:
    """Tiles for the GEMV: the winners of `bench/weight_only.py --gemv` on an H200 (BENCHMARKS.md). A group wider
    than BLOCK_K widens the K step to it."""
    return dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=2, programs=1056)


@functools.lru_cache(maxsize=1024)
def _launch_plan(N: int, K: int, group: int, config: tuple):
    """(N tiles, K slices, meta-parameters) of the GEMV at a shape, worked out once."""
    cfg = dict(config)
    block_k = max(cfg["BLOCK_K"], group)  # whole groups per K step (both are powers of two)
    tiles = cdiv(N, cfg["BLOCK_N"])
    split = split_k(tiles, cdiv(K, block_k), cfg["programs"])
    meta = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return tiles, split, meta


def weight_only_gemv(a, codes, scale, group: int, N: int, zero_point, bias, config=None):
    """a [1, K] times the int4 weight as `weight_only_mm` passes it: packed rows as int32 words [N, K/8], fp32
    scales [N, K/group] and uint8 zero points (or None: symmetric codes). Returns [1, N] in a's dtype."""
    K = a.shape[1]
    tiles, split, meta = _launch_plan(N, K, group, tuple(sorted((config or wo_gemv_config()).items())))
    out = torch.empty((1, N), dtype=a.dtype, device=a.device)
    ws = torch.empty((split, 1, N), dtype=torch.float32, device=a.device) if split > 1 else out
    _wo_gemv_kernel[(tiles, split)](
        a, codes, scale, zero_point if zero_point is not None else scale, out, ws, bias if bias is not None else out,
        N, K, a.stride(1), codes.stride(0), scale.stride(0), scale.stride(1), out.stride(1),
        GROUP=group, HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None, SPLIT_K=split,
        OUT=TORCH_TO_TL[a.dtype], CAST=float_cast_mode(_wo_gemv_kernel), **meta,
    )
    if split > 1:
        reduce_partials(ws, out, bias, TORCH_TO_TL[a.dtype])
    return out
