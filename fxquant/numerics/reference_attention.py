"""The oracle for decode attention (`fxquant::decode_attention`): attention of a few query positions over a KV
cache stored [B, Hkv, S, D], in fp32.

- Query head h reads KV head h // (Hq / Hkv), as transformers' repeat_kv pairs them.
- The cache is high precision, or e4m3 codes with fp32 scales per (batch, KV head, token) (k_scale, v_scale
  [B, Hkv, S]) or per tensor ([1]): a value is code * scale.
- mask: additive (float, -inf or the dtype's min where a key is hidden) or boolean (True attends), broadcast to
  [B, Hq, Q, S]: left padding, sliding windows and causality within the queries come from it, as transformers
  builds it.
- softcap > 0: scores pass through softcap * tanh(score / softcap) before the mask (Gemma2).
- sinks [Hq]: one logit per head that joins the softmax's denominator and attends to nothing (GPT-OSS).
- kv_lens [B]: each sequence's filled length in the cache; keys past it are hidden (and the kernel never reads
  them).
- A row whose every key is masked attends to nothing: its output is 0, never NaN.
"""

from __future__ import annotations

import torch


def dequantized_cache(codes: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The cache's values in fp32: codes * scale per (batch, head, token), or the high-precision cache."""
    if scale is None:
        return codes.float()
    per_token = scale.float() if scale.numel() == 1 else scale.float()[..., None]  # [B, Hkv, S, 1]
    return codes.float() * per_token


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     scale: float | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     kv_lens: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale [+ mask]) v for q [B, Hq, Q, D] over k, v [B, Hkv, S, D]; [B, Hq, Q, D] in q's dtype.
    kv_lens [B]: each sequence's filled length; keys past it are hidden."""
    groups = q.shape[1] // k.shape[1]
    kf = dequantized_cache(k, k_scale).repeat_interleave(groups, dim=1)  # [B, Hq, S, D]
    vf = dequantized_cache(v, v_scale).repeat_interleave(groups, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if kv_lens is not None:
        filled = torch.arange(k.shape[2], device=k.device)[None, :] < kv_lens[:, None]  # [B, S]
        scores = scores.masked_fill(~filled[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # every key masked: exp(-inf) = 0, no NaN
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    if sinks is not None:
        weights = weights[..., :-1]
    probs = torch.where(total > 0, weights / total, torch.zeros_like(weights))
    return (probs @ vf).to(q.dtype)
