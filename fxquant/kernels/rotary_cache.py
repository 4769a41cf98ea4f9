"""Rotary embedding and the KV cache write of a decode step in one kernel: q and k rotated, k and v written into
the cache at their positions, q returned. Inductor otherwise spends three to five kernels a layer on them.

The rotation is transformers' `rotate_half` form over the whole head: out = x * cos + rotate_half(x) * sin, with
rotate_half(x) = cat(-x[D/2:], x[:D/2]); cos and sin in x's dtype or in fp32 (the graph's values before their
rounding, as Inductor reads them). It is computed in fp64, where the products of a bf16 or fp16 x and an fp32 cos
are exact, so the sum rounds once, with or without an FMA; then to fp32 and to x's dtype, each to nearest even: the
bits of `fxquant.numerics.reference_rotary` on every backend.

One program per row: a (batch, query head, position) of q, or a (batch, KV head, position) of k with its v. A
position outside the cache writes nothing, where index_copy_ would raise on the CPU and write out of bounds on the
GPU; the reference does the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, float_cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import next_power_of_2, visible

TL_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_HEAD_DIM = 512


@triton.jit
def _rotated(x_ptr, x_stride, c_ptr, c_stride, s_ptr, s_stride, offs, mask, HALF: tl.constexpr):
    """The two halves of x's rotary embedding in fp32: x1 * c1 - x2 * s1 and x2 * c2 + x1 * s2."""
    x1 = tl.load(x_ptr + offs * x_stride, mask=mask, other=0.0).to(tl.float64)
    x2 = tl.load(x_ptr + (offs + HALF) * x_stride, mask=mask, other=0.0).to(tl.float64)
    c1 = tl.load(c_ptr + offs * c_stride, mask=mask, other=0.0).to(tl.float64)
    c2 = tl.load(c_ptr + (offs + HALF) * c_stride, mask=mask, other=0.0).to(tl.float64)
    s1 = tl.load(s_ptr + offs * s_stride, mask=mask, other=0.0).to(tl.float64)
    s2 = tl.load(s_ptr + (offs + HALF) * s_stride, mask=mask, other=0.0).to(tl.float64)
    # fp64: the products (at most 11 x 24 significand bits) are exact, so an FMA or not gives the same sum, which
    # rounds once; then fp32 by the round-to-nearest-even conversion.
    return (x1 * c1 - x2 * s1).to(tl.float32), (x2 * c2 + x1 * s2).to(tl.float32)


@triton.jit
def _rotary_cache_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, kc_ptr, vc_ptr,
    B, HQ, HKV, Q, S,
    sqb, sqh, sqq, sqd, skb, skh, skq, skd, svb, svh, svq, svd,
    scb, scq, scd, ssb, ssq, ssd,
    skcb, skch, skcs, skcd, svcb, svch, svcs, svcd,
    HALF: tl.constexpr, DV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_DV: tl.constexpr,
    DTYPE: tl.constexpr, CAST: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    q_rows = B * HQ * Q
    if row < q_rows:
        b, h, i = row // (HQ * Q), (row // Q) % HQ, row % Q
        c_ptr, s_ptr = cos_ptr + b * scb + i * scq, sin_ptr + b * ssb + i * ssq
        lo, hi = _rotated(q_ptr + b * sqb + h * sqh + i * sqq, sqd, c_ptr, scd, s_ptr, ssd, offs, mask, HALF)
        out = out_ptr + row.to(tl.int64) * (2 * HALF)  # [B, HQ, Q, D] contiguous
        tl.store(out + offs, cast_float(lo, DTYPE, CAST), mask=mask)
        tl.store(out + HALF + offs, cast_float(hi, DTYPE, CAST), mask=mask)
    else:
        kv = row - q_rows
        b, h, i = kv // (HKV * Q), (kv // Q) % HKV, kv % Q
        c_ptr, s_ptr = cos_ptr + b * scb + i * scq, sin_ptr + b * ssb + i * ssq
        lo, hi = _rotated(k_ptr + b * skb + h * skh + i * skq, skd, c_ptr, scd, s_ptr, ssd, offs, mask, HALF)
        position = tl.load(pos_ptr + i)
        inside = (position >= 0) & (position < S)
        kc = kc_ptr + b.to(tl.int64) * skcb + h * skch + position * skcs
        tl.store(kc + offs * skcd, cast_float(lo, DTYPE, CAST), mask=mask & inside)
        tl.store(kc + (offs + HALF) * skcd, cast_float(hi, DTYPE, CAST), mask=mask & inside)
        offs_v = tl.arange(0, BLOCK_DV)
        mask_v = offs_v < DV
        v = tl.load(v_ptr + b * svb + h * svh + i * svq + offs_v * svd, mask=mask_v)
        vc = vc_ptr + b.to(tl.int64) * svcb + h * svch + position * svcs
        tl.store(vc + offs_v * svcd, v, mask=mask_v & inside)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> str | None:
    """None where the kernel computes the op as the reference does, else why not."""
    tensors = (q, k, v, k_cache, v_cache)
    if any(t.dtype != q.dtype for t in tensors) or q.dtype not in TL_TYPES:
        return f"q, k, v and the caches of dtypes {sorted({str(t.dtype) for t in tensors})}, not all bf16 or fp16"
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, torch.float32):
        return f"cos and sin of {cos.dtype} and {sin.dtype}: both q's dtype or both fp32"
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or q.shape[-1] > MAX_HEAD_DIM:
        return f"q {tuple(q.shape)}: not [B, H, Q, D] with an even D up to {MAX_HEAD_DIM}"
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        return "positions that are not one integer per query position"
    return None


def rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache) -> torch.Tensor:
    """q [B, HQ, Q, D], k [B, HKV, Q, D], v [B, HKV, Q, DV], cos and sin (q's dtype or fp32) broadcastable to
    [B, 1, Q, D], positions [Q];
    writes rotated k and v into k_cache [B, HKV, S, D] and v_cache [B, HKV, S, DV] at `positions`; returns q rotated,
    contiguous."""
    B, HQ, Q, D = q.shape
    HKV, S, DV = k.shape[1], k_cache.shape[2], v.shape[-1]
    cos, sin = (t.expand(B, 1, Q, D)[:, 0] for t in (cos, sin))  # [B, Q, D], stride 0 where broadcast
    out = torch.empty((B, HQ, Q, D), dtype=q.dtype, device=q.device)
    rows = B * (HQ + HKV) * Q
    if rows == 0:
        return out
    kernel = _rotary_cache_write_kernel
    visible(kernel)[(rows,)](
        q, k, v, cos, sin, positions, out, k_cache, v_cache,
        B, HQ, HKV, Q, S,
        *q.stride(), *k.stride(), *v.stride(),
        *cos.stride(), *sin.stride(),
        *k_cache.stride(), *v_cache.stride(),
        HALF=D // 2, DV=DV, BLOCK_HALF=next_power_of_2(D // 2), BLOCK_DV=next_power_of_2(DV),
        DTYPE=TL_TYPES[q.dtype], CAST=float_cast_mode(kernel), num_warps=1, **launch_options(q.device),
    )
    return out
