"""The oracle for `fxquant::rotary_cache_write`: a decode step's rotary embedding of q and k (transformers'
`rotate_half` form over the whole head) and its KV cache write, as transformers' StaticCache does it.

- x rotated: x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]); x bf16 or
  fp16, cos and sin in x's dtype or fp32, as wide as x or half as wide: one for both halves, GPT-OSS's
  cat((a * c - b * s, b * c + a * s)) with a, b = x.chunk(2), the same rotation. Computed in fp64, where those
  products are exact, so the sum rounds once; then to fp32 and to x's dtype. With fp32 cos and sin (the values a
  graph rounds to x's dtype, which Inductor's code reads unrounded) this is Inductor's fp32 arithmetic without its
  roundings of the products; eager's bf16 ops round the cos, each product and the sum.
- The rotated k and v are written into the caches [B, Hkv, S, D] at `positions` (dim 2), as index_copy_. A
  position outside [0, S) writes nothing.
- An e4m3 cache (`fxquant.FP8StaticCache`) holds each row as `fxquant::quantize_fp8(row, 0)` makes it: the rotated
  k (or v) in its dtype, quantized with a scale per (token, KV head); the codes go to uint8 caches at `positions`,
  the scales to fp32 caches [B, Hkv, S, 1] at `scale_positions` (the cache's twin layer counts its own).
- Appended (`rotary_cache_append`): the positions are the cache's length L (a 0-d integer tensor, transformers'
  `cumulative_length`) plus 0..Q-1, for codes and scales alike, and L grows by Q after the writes.
"""

from __future__ import annotations

import torch

from fxquant.numerics import reference as R
from fxquant.numerics.granularity import activation_granularity


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    if cos.shape[-1] == half:  # GPT-OSS's spelling: the same cos and sin for both halves
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # fp64: exact products of a bf16/fp16 x and an fp32 cos, one rounding of the sum, then fp32, then x's dtype
    return (x.double() * cos.double() + turned.double() * sin.double()).float().to(x.dtype)


def rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache) -> torch.Tensor:
    """q and k [B, H, Q, D] rotated by cos and sin (broadcast to [B, 1, Q, D]); k rotated and v written into k_cache
    and v_cache at positions [Q]; returns q rotated, contiguous (as the kernel writes it and the op's fake says)."""
    inside = (positions >= 0) & (positions < k_cache.shape[2])
    k_cache.index_copy_(2, positions[inside], rotated(k, cos, sin)[:, :, inside])
    v_cache.index_copy_(2, positions[inside], v[:, :, inside])
    return rotated(q, cos, sin).contiguous()


def rotary_cache_write_e4m3(q, k, v, cos, sin, positions, scale_positions, k_codes, v_codes, k_scales,
                            v_scales) -> torch.Tensor:
    """rotary_cache_write into an e4m3 cache: codes (uint8) at positions, their scales at scale_positions."""
    inside = ((positions >= 0) & (positions < k_codes.shape[2]) & (scale_positions >= 0)
              & (scale_positions < k_scales.shape[2]))
    for row, codes, scales in ((rotated(k, cos, sin), k_codes, k_scales), (v, v_codes, v_scales)):
        quantized = R.quantize(row, "fp8_e4m3", activation_granularity(0))  # per (token, KV head), as quantize_fp8
        codes.index_copy_(2, positions[inside], quantized.data.view(torch.uint8)[:, :, inside])
        scales.index_copy_(2, scale_positions[inside], quantized.scale[:, :, inside])
    return rotated(q, cos, sin).contiguous()


def _appended(length: torch.Tensor, queries: int) -> torch.Tensor:
    """The positions a step of `queries` tokens appends at: length + 0, ..., length + queries - 1."""
    return length.reshape(()) + torch.arange(queries, device=length.device)


def rotary_cache_append(q, k, v, cos, sin, length, k_cache, v_cache) -> torch.Tensor:
    """rotary_cache_write at the cache's length, which then grows by the Q positions written."""
    out = rotary_cache_write(q, k, v, cos, sin, _appended(length, q.shape[2]), k_cache, v_cache)
    length.add_(q.shape[2])
    return out


def rotary_cache_append_e4m3(q, k, v, cos, sin, length, k_codes, v_codes, k_scales, v_scales) -> torch.Tensor:
    """rotary_cache_write_e4m3 with codes and scales at the cache's length, which then grows by Q."""
    positions = _appended(length, q.shape[2])
    out = rotary_cache_write_e4m3(q, k, v, cos, sin, positions, positions, k_codes, v_codes, k_scales, v_scales)
    length.add_(q.shape[2])
    return out
