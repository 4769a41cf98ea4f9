"""The oracle for `fxquant::rotary_cache_write`: a decode step's rotary embedding of q and k (transformers'
`rotate_half` form over the whole head) and its KV cache write, as transformers' StaticCache does it.

- x rotated: x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), computed in
  fp32 and rounded once to x's dtype. For bf16 and fp16 operands the products are exact in fp32, so the sum is the
  only rounding. Eager's bf16 ops round each product first; Inductor's code reads cos and sin before their rounding
  to x's dtype. Either differs from this by one ulp in some elements (20 of a Llama key row's 128, on the CPU).
- The rotated k and v are written into the caches [B, Hkv, S, D] at `positions` (dim 2), as index_copy_. A
  position outside [0, S) writes nothing.
"""

from __future__ import annotations

import torch


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # fp32: exact products of bf16/fp16 operands, then one rounding of their sum to x's dtype
    return (x.float() * cos.float() + turned.float() * sin.float()).to(x.dtype)


def rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache) -> torch.Tensor:
    """q and k [B, H, Q, D] rotated by cos and sin (broadcast to [B, 1, Q, D]); k rotated and v written into k_cache
    and v_cache at positions [Q]; returns q rotated."""
    inside = (positions >= 0) & (positions < k_cache.shape[2])
    k_cache.index_copy_(2, positions[inside], rotated(k, cos, sin)[:, :, inside])
    v_cache.index_copy_(2, positions[inside], v[:, :, inside])
    return rotated(q, cos, sin)
