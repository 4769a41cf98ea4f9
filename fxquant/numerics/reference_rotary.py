"""The oracle for `fxquant::rotary_cache_write`: a decode step's rotary embedding of q and k (transformers'
`rotate_half` form over the whole head) and its KV cache write, as transformers' StaticCache does it.

- x rotated: x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]); x bf16 or
  fp16, cos and sin in x's dtype or fp32. Computed in fp64, where those products are exact, so the sum rounds once;
  then to fp32 and to x's dtype. With fp32 cos and sin (the values a graph rounds to x's dtype, which Inductor's code
  reads unrounded) this is Inductor's fp32 arithmetic without its roundings of the products; eager's bf16 ops round
  the cos, each product and the sum.
- The rotated k and v are written into the caches [B, Hkv, S, D] at `positions` (dim 2), as index_copy_. A
  position outside [0, S) writes nothing.
"""

from __future__ import annotations

import torch


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # fp64: exact products of a bf16/fp16 x and an fp32 cos, one rounding of the sum, then fp32, then x's dtype
    return (x.double() * cos.double() + turned.double() * sin.double()).float().to(x.dtype)


def rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache) -> torch.Tensor:
    """q and k [B, H, Q, D] rotated by cos and sin (broadcast to [B, 1, Q, D]); k rotated and v written into k_cache
    and v_cache at positions [Q]; returns q rotated."""
    inside = (positions >= 0) & (positions < k_cache.shape[2])
    k_cache.index_copy_(2, positions[inside], rotated(k, cos, sin)[:, :, inside])
    v_cache.index_copy_(2, positions[inside], v[:, :, inside])
    return rotated(q, cos, sin)
