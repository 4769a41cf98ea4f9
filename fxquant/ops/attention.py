"""The attention ops: decode attention over the KV cache as stored (alone, or with its output quantized for the
o-projection), an e4m3 cache dequantized, and a decode step's rotary embedding with its cache write (at given
positions, or appended at the cache's length, which it grows)."""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.kernels.decode_attention import decode_attention as decode_attention_kernel
from fxquant.kernels.decode_attention import decode_attention_quantized, output_like
from fxquant.kernels.decode_attention import supports as decode_attention_supports
from fxquant.kernels.quant_fp8 import row_refusal
from fxquant.kernels.rotary_cache import rotary_cache_write as rotary_cache_kernel
from fxquant.kernels.rotary_cache import supports as rotary_cache_supports
from fxquant.kernels.rotary_cache import supports_codes as rotary_codes_supports
from fxquant.numerics import reference_attention as RA
from fxquant.numerics import reference_rotary as RR
from fxquant.ops.declare import define, fake
from fxquant.ops.linear import quantize_fp8


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float,
                      sinks: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None,
                      kv_lens: Tensor | None) -> Tensor:
    """Attention of q [B, Hq, Q, D] over a KV cache k, v [B, Hkv, S, D] read as stored (high precision, or e4m3
    codes with fp32 k_scale / v_scale per (batch, KV head, token) or per tensor): reference_attention's numerics.
    CUDA: the split-KV kernel where it serves the operands; else the reference."""
    if q.is_cuda and decode_attention_supports(q, k, v, mask) is None:
        return decode_attention_kernel(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens)
    out = output_like(q)  # the kernel's layout, which the fake gives
    return out.copy_(RA.decode_attention(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens))


# The decode ops read their operands through their strides (attention asks a unit stride along the head dim, which
# Inductor's layouts keep), so Inductor may hand them the inputs it computes (the mask, cos and sin, the positions)
# in the layout they have. Under the default, exact strides, it copied such an input for each call that read it,
# recomputing it there: transformers' mask once a layer, on the GPU a kernel of its own (1.0 us a layer at B1).
DECODE_TAGS = (torch.Tag.flexible_layout,)
decode_attention = define("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap, "
                       "Tensor? sinks, Tensor? k_scale, Tensor? v_scale, Tensor? kv_lens) -> Tensor",
                       _decode_attention, DECODE_TAGS)


@fake("decode_attention")
def _(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens):
    return output_like(q)


def _decode_attention_quantize_fp8(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
                                   softcap: float, sinks: Tensor | None, k_scale: Tensor | None,
                                   v_scale: Tensor | None, kv_lens: Tensor | None,
                                   group_size: int) -> tuple[Tensor, Tensor]:
    """quantize_fp8(o.transpose(1, 2).reshape(B, Q, Hq * D), group_size) of decode_attention's output o [B, Hq, Q,
    D]: the o-projection's input as its quantizer makes it, bit for bit. CUDA: the kernel quantizes as it merges
    (`decode_attention_quantized`), where it serves the operands; else the reference, then the quantizer."""
    batch, heads_q, queries, dim = q.shape
    if q.is_cuda and decode_attention_supports(q, k, v, mask) is None and row_refusal(group_size or heads_q * dim) \
            is None:
        return decode_attention_quantized(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens, group_size)
    out = _decode_attention(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens)
    return quantize_fp8(out.transpose(1, 2).reshape(batch, queries, heads_q * dim), group_size)


decode_attention_quantize_fp8 = define(
    "decode_attention_quantize_fp8(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap, "
    "Tensor? sinks, Tensor? k_scale, Tensor? v_scale, Tensor? kv_lens, int group_size) -> (Tensor, Tensor)",
    _decode_attention_quantize_fp8, DECODE_TAGS)


@fake("decode_attention_quantize_fp8")
def _(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens, group_size):
    batch, heads_q, queries, dim = q.shape
    return torch.ops.fxquant.quantize_fp8.default(q.new_empty((batch, queries, heads_q * dim)), group_size)


def _dequantize_kv(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """An e4m3 KV cache [B, Hkv, S, D] in `dtype`: codes * scale, per (batch, KV head, token) (scale [B, Hkv, S])
    or per tensor ([1]), in fp32, then one rounding to dtype."""
    return RA.dequantized_cache(codes, scale).to(dtype)


dequantize_kv = define("dequantize_kv(Tensor codes, Tensor scale, ScalarType dtype) -> Tensor", _dequantize_kv)


@fake("dequantize_kv")
def _(codes, scale, dtype):
    return torch.empty_like(codes, dtype=dtype)


def _rotary_cache_write(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                        k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """q and k rotated (transformers' rotate_half form), k and v written into the caches at `positions`, q
    returned: `reference_rotary`'s numerics. CUDA: one kernel where it serves the operands; else the reference."""
    if q.is_cuda and rotary_cache_supports(q, k, v, cos, sin, positions, k_cache, v_cache) is None:
        return rotary_cache_kernel(q, k, v, cos, sin, positions, k_cache, v_cache)
    return RR.rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache)


rotary_cache_write = define("rotary_cache_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
                            "Tensor positions, Tensor(a!) k_cache, Tensor(b!) v_cache) -> Tensor",
                            _rotary_cache_write, DECODE_TAGS)



def _rotary_cache_write_e4m3(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor,
                             scale_positions: Tensor, k_codes: Tensor, v_codes: Tensor, k_scales: Tensor,
                             v_scales: Tensor) -> Tensor:
    """rotary_cache_write into an e4m3 cache (fxquant.FP8StaticCache): k and v quantized per (token, KV head), their
    codes (uint8) written at `positions` and their fp32 scales at `scale_positions`."""
    if (q.is_cuda and rotary_cache_supports(q, k, v, cos, sin, positions, k_codes, v_codes) is None
            and rotary_codes_supports(q, k_codes, k_scales, v_scales) is None):
        return rotary_cache_kernel(q, k, v, cos, sin, positions, k_codes, v_codes,
                                   codes=(scale_positions, k_scales, v_scales))
    return RR.rotary_cache_write_e4m3(q, k, v, cos, sin, positions, scale_positions, k_codes, v_codes, k_scales,
                                      v_scales)


rotary_cache_write_e4m3 = define("rotary_cache_write_e4m3(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
                                 "Tensor positions, Tensor scale_positions, Tensor(a!) k_codes, Tensor(b!) v_codes, "
                                 "Tensor(c!) k_scales, Tensor(d!) v_scales) -> Tensor", _rotary_cache_write_e4m3,
                                 DECODE_TAGS)



def _rotary_cache_append(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, length: Tensor,
                         k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """rotary_cache_write at the cache's length (a 0-d integer tensor, transformers' `cumulative_length`): k and v
    written at length + 0..Q-1, then the length grown by Q. CUDA: one kernel where it serves the operands."""
    if q.is_cuda and rotary_cache_supports(q, k, v, cos, sin, length, k_cache, v_cache, append=True) is None:
        return rotary_cache_kernel(q, k, v, cos, sin, length, k_cache, v_cache, append=True)
    return RR.rotary_cache_append(q, k, v, cos, sin, length, k_cache, v_cache)


rotary_cache_append = define("rotary_cache_append(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
                             "Tensor(a!) length, Tensor(b!) k_cache, Tensor(c!) v_cache) -> Tensor",
                             _rotary_cache_append, DECODE_TAGS)



def _rotary_cache_append_e4m3(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, length: Tensor,
                              k_codes: Tensor, v_codes: Tensor, k_scales: Tensor, v_scales: Tensor) -> Tensor:
    """rotary_cache_write_e4m3 at the cache's length, codes and scales alike, then the length grown by Q."""
    if (q.is_cuda and rotary_cache_supports(q, k, v, cos, sin, length, k_codes, v_codes, append=True) is None
            and rotary_codes_supports(q, k_codes, k_scales, v_scales) is None):
        return rotary_cache_kernel(q, k, v, cos, sin, length, k_codes, v_codes, codes=(length, k_scales, v_scales),
                                   append=True)
    return RR.rotary_cache_append_e4m3(q, k, v, cos, sin, length, k_codes, v_codes, k_scales, v_scales)


rotary_cache_append_e4m3 = define("rotary_cache_append_e4m3(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, "
                                  "Tensor(a!) length, Tensor(b!) k_codes, Tensor(c!) v_codes, Tensor(d!) k_scales, "
                                  "Tensor(e!) v_scales) -> Tensor", _rotary_cache_append_e4m3, DECODE_TAGS)


def _rotated_query(q: Tensor, *operands) -> Tensor:
    """What the rotary ops return: q rotated, contiguous."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


for _rotary_op in ("rotary_cache_write", "rotary_cache_write_e4m3", "rotary_cache_append", "rotary_cache_append_e4m3"):
    fake(_rotary_op)(_rotated_query)
