"""Rotary embedding and the KV cache write of a decode step in one kernel: q and k rotated, k and v written into
the cache at their positions (as they are, or as e4m3 codes with a scale per row), q returned. Inductor otherwise
spends three to five kernels a layer on them, and the e4m3 cache two quantizers more.

The rotation is transformers' `rotate_half` form over the whole head: out = x * cos + rotate_half(x) * sin, with
rotate_half(x) = cat(-x[D/2:], x[:D/2]); cos and sin in x's dtype or in fp32 (the graph's values before their
rounding, as Inductor reads them), as wide as the head or half as wide (GPT-OSS's spelling: one for both halves).
It is computed in fp64, where the products of a bf16 or fp16 x and an fp32 cos are exact, so the sum rounds once,
with or without an FMA; then to fp32 and to x's dtype, each to nearest even: the bits of
`fxquant.numerics.reference_rotary` on every backend. An e4m3 cache row is the rotated k (or v) in x's dtype
quantized by the row quantizer's own code (`quant_rows`): the bits of `fxquant::quantize_fp8(x, 0)`.

One program per row: a (batch, query head, position) of q, or a (batch, KV head, position) of k with its v. A
position outside the cache writes nothing, where index_copy_ would raise on the CPU and write out of bounds on the
GPU; the reference does the same. In the 32-layer step it took the kernels a layer from 14.25 to 12.6 at B1
(docs/decisions/0022-rotary-and-cache-write-in-one-kernel.md).

Appending (`append`), the positions are the cache's length plus 0..Q-1, and the last k/v row to count itself in at an
arrival counter grows the length, once every row has read it: transformers' `arange + cumulative_length` and
`cumulative_length.add_`, a kernel a layer, leave the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability, cast_float, cast_mode, float_cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import next_power_of_2, visible
from fxquant.kernels.quant_fp8 import quant_rows
from fxquant.kernels.splitk import counters
from fxquant.numerics.formats import AMAX_FLOOR, E4M3

TL_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MAX_HEAD_DIM = 512


@triton.jit
def _rotated(x_ptr, x_stride, c_ptr, c_stride, s_ptr, s_stride, offs, mask, HALF: tl.constexpr,
             HALF_COS: tl.constexpr):
    """x's rotary embedding at offs (< 2 * HALF), in fp32: x * cos + rotate_half(x) * sin."""
    turned = tl.where(offs < HALF, offs + HALF, offs - HALF)  # rotate_half's source of each element
    x = tl.load(x_ptr + offs * x_stride, mask=mask, other=0.0).to(tl.float64)
    t = tl.load(x_ptr + turned * x_stride, mask=mask, other=0.0).to(tl.float64)
    t = tl.where(offs < HALF, -t, t)
    offs_cs = offs % HALF if HALF_COS else offs  # half-width cos and sin serve both halves
    c = tl.load(c_ptr + offs_cs * c_stride, mask=mask, other=0.0).to(tl.float64)
    s = tl.load(s_ptr + offs_cs * s_stride, mask=mask, other=0.0).to(tl.float64)
    # fp64: the products (at most 11 x 24 significand bits) are exact, so an FMA or not gives the same sum, which
    # rounds once; then fp32 by the round-to-nearest-even conversion.
    return (x * c + t * s).to(tl.float32)


@triton.jit
def _write_row(row, cache_ptr, scale_ptr, offs, mask, inside, E4M3_CODES: tl.constexpr, FMAX: tl.constexpr,
               FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """Store one cache row (in the cache's dtype, rounded) as it is, or as e4m3 codes with its scale."""
    if E4M3_CODES:
        codes, scale = quant_rows(row.to(tl.float32)[None, :], FMAX, FP8, CAST, AMAX_FLOOR)
        tl.store(cache_ptr + offs[None, :], codes.to(tl.uint8, bitcast=True), mask=mask[None, :] & inside)
        tl.store(scale_ptr + tl.arange(0, 1), scale, mask=inside)
    else:
        tl.store(cache_ptr + offs, row, mask=mask & inside)


@triton.jit
def _rotary_cache_write_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, scale_pos_ptr, out_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
    arrivals_ptr, B, HQ, HKV, Q, S, stride_pos, stride_scale_pos,
    sqb, sqh, sqq, sqd, skb, skh, skq, skd, svb, svh, svq, svd,
    scb, scq, scd, ssb, ssq, ssd,
    skcb, skch, skcs, skcd, svcb, svch, svcs, svcd, sksb, sksh, skss, svsb, svsh, svss,
    HALF: tl.constexpr, HALF_COS: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DTYPE: tl.constexpr, CAST: tl.constexpr, E4M3_CODES: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, APPEND: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < 2 * HALF
    q_rows = B * HQ * Q
    if row < q_rows:
        b, h, i = row // (HQ * Q), (row // Q) % HQ, row % Q
        rotated = _rotated(q_ptr + b * sqb + h * sqh + i * sqq, sqd, cos_ptr + b * scb + i * scq, scd,
                           sin_ptr + b * ssb + i * ssq, ssd, offs, mask, HALF, HALF_COS)
        tl.store(out_ptr + row.to(tl.int64) * (2 * HALF) + offs, cast_float(rotated, DTYPE, CAST), mask=mask)
    else:
        kv = row - q_rows
        b, h, i = kv // (HKV * Q), (kv // Q) % HKV, kv % Q
        rotated = _rotated(k_ptr + b * skb + h * skh + i * skq, skd, cos_ptr + b * scb + i * scq, scd,
                           sin_ptr + b * ssb + i * ssq, ssd, offs, mask, HALF, HALF_COS)
        if APPEND:  # pos_ptr holds the cache's length: codes and scales go at length + i
            length = tl.load(pos_ptr)
            position = length + i
            scale_position = position
        else:
            position = tl.load(pos_ptr + i * stride_pos)
            scale_position = tl.load(scale_pos_ptr + i * stride_scale_pos)  # an e4m3 cache's scales: their own
        inside = (position >= 0) & (position < S)
        scale_inside = (scale_position >= 0) & (scale_position < S)
        kc = kc_ptr + b.to(tl.int64) * skcb + h * skch + position * skcs
        ks = ks_ptr + b.to(tl.int64) * sksb + h * sksh + scale_position * skss
        _write_row(cast_float(rotated, DTYPE, CAST), kc, ks, offs * skcd, mask, inside & scale_inside,
                   E4M3_CODES, FMAX, FP8, CAST, AMAX_FLOOR)
        offs_v = tl.arange(0, BLOCK_DV)
        mask_v = offs_v < DV
        v = tl.load(v_ptr + b * svb + h * svh + i * svq + offs_v * svd, mask=mask_v, other=0.0)
        vc = vc_ptr + b.to(tl.int64) * svcb + h * svch + position * svcs
        vs = vs_ptr + b.to(tl.int64) * svsb + h * svsh + scale_position * svss
        _write_row(v, vc, vs, offs_v * svcd, mask_v, inside & scale_inside, E4M3_CODES, FMAX, FP8, CAST,
                   AMAX_FLOOR)
        if ADVANCE:  # the last k/v row to have read the length grows it: no row reads the grown one
            tl.debug_barrier()  # every thread's read of the length is done before the count releases it
            arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
            if arrived == B * HKV * Q - 1:
                tl.store(pos_ptr, length + Q)
                tl.store(arrivals_ptr, 0)  # the next kernel to count waits for this one to end


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, append: bool = False) -> str | None:
    """None where the kernel computes the op as the reference does, else why not. The caches: q's dtype, or uint8
    holding e4m3 codes. append: `positions` is the cache's length, one integer."""
    tensors = (q, k, v) + tuple(c for c in (k_cache, v_cache) if c.dtype != torch.uint8)
    if any(t.dtype != q.dtype for t in tensors) or q.dtype not in TL_TYPES:
        return f"q, k, v and the caches of dtypes {sorted({str(t.dtype) for t in tensors})}, not all bf16 or fp16"
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, torch.float32):
        return f"cos and sin of {cos.dtype} and {sin.dtype}: both q's dtype or both fp32"
    if cos.shape[-1] != sin.shape[-1] or cos.shape[-1] not in (q.shape[-1], q.shape[-1] // 2):
        return f"cos and sin {cos.shape[-1]} and {sin.shape[-1]} wide: as wide as the head or half as wide"
    if q.dim() != 4 or k.dim() != 4 or q.shape[-1] % 2 or q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"q {tuple(q.shape)}: not [B, H, Q, D] with an even D up to {MAX_HEAD_DIM}"
    if positions.dtype not in (torch.int32, torch.int64):
        return f"positions of {positions.dtype}, not int32 or int64"
    if append and (positions.numel() != 1 or positions.dim() > 1):
        return f"a cache length of shape {tuple(positions.shape)}, not one integer"
    if not append and positions.dim() != 1:
        return "positions that are not one integer per query position"
    return None


def supports_codes(q: torch.Tensor, k_codes: torch.Tensor, k_scales: torch.Tensor,
                   v_scales: torch.Tensor) -> str | None:
    """Beyond `supports`, for an e4m3 cache: fp32 scales [B, HKV, S, 1] beside codes [B, HKV, S, D], and a GPU with
    fp8 conversions."""
    if any(s.dtype != torch.float32 or s.dim() != 4 or s.shape[-1] != 1 or s.shape[:3] != k_codes.shape[:3]
           for s in (k_scales, v_scales)):
        return "scales that are not fp32 [B, HKV, S, 1] beside the codes"
    if q.is_cuda and capability(q.device) < (8, 9):
        return "a GPU without fp8 conversions (sm_89 and later have them)"
    return None


def rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache, codes=None, append=False) -> torch.Tensor:
    """q [B, HQ, Q, D], k [B, HKV, Q, D], v [B, HKV, Q, DV], cos and sin (q's dtype or fp32) broadcastable to
    [B, 1, Q, D] or [B, 1, Q, D / 2], positions [Q]; writes rotated k and v into k_cache [B, HKV, S, D] and v_cache
    [B, HKV, S, DV] at `positions`; returns q rotated, contiguous. codes: (scale_positions [Q], k_scales, v_scales
    [B, HKV, S, 1] fp32) where the caches are uint8 views of e4m3 codes, whose scales go to scale_positions.
    append: `positions` is the cache's length L instead (one integer, transformers' `cumulative_length`); k and v
    go at L + i, codes and scales alike, and L grows by Q: in the kernel, by the last k/v row to read it, where the
    split GEMMs' counters serve; else by an add after it."""
    B, HQ, Q, D = q.shape
    HKV, S, DV = k.shape[1], k_cache.shape[2], v.shape[-1]
    width = cos.shape[-1]  # D, or D / 2 for both halves
    cos, sin = (t.expand(B, 1, Q, width)[:, 0] for t in (cos, sin))  # [B, Q, width], stride 0 where broadcast
    out = torch.empty((B, HQ, Q, D), dtype=q.dtype, device=q.device)
    rows = B * (HQ + HKV) * Q
    arrivals = counters(q.device, 1) if append and rows else None
    if rows:
        scale_positions, k_scales, v_scales = codes if codes is not None else (positions, k_cache, v_cache)
        kernel = _rotary_cache_write_kernel
        visible(kernel)[(rows,)](
            q, k, v, cos, sin, positions, scale_positions, out, k_cache, v_cache, k_scales, v_scales,
            positions if arrivals is None else arrivals, B, HQ, HKV, Q, S,
            positions.stride(0) if positions.dim() else 0, scale_positions.stride(0) if scale_positions.dim() else 0,
            *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(),
            *k_cache.stride(), *v_cache.stride(), *k_scales.stride()[:3], *v_scales.stride()[:3],
            HALF=D // 2, HALF_COS=width != D, DV=DV, BLOCK_D=next_power_of_2(D), BLOCK_DV=next_power_of_2(DV),
            DTYPE=TL_TYPES[q.dtype],
            CAST=cast_mode(kernel, q.device) if codes is not None else float_cast_mode(kernel),  # fp8: e4m3 only
            E4M3_CODES=codes is not None, FMAX=E4M3.max, FP8=tl.float8e4nv, AMAX_FLOOR=AMAX_FLOOR, APPEND=append,
            ADVANCE=arrivals is not None, num_warps=1, **launch_options(q.device),
        )
    if append and arrivals is None:
        positions.add_(Q)
    return out
