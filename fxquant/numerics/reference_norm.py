"""The oracle for the fused norm -> fp8 kernels: RMSNorm / LayerNorm in fp32, rounded where the graph rounds.

The residual sum and the norm's output are rounded to the model's dtype, exactly where the unfused graph
(add, then norm, then quantize_fp8) has them in that dtype, so fusing changes no number but the statistics.
The statistics (mean, rstd) are sums whose order a kernel cannot share with torch; `stats` lets a test pass
a kernel's own statistics in, so everything after them is compared bit for bit.
"""

from __future__ import annotations

import torch

from fxquant.numerics.reference import fdiv, quantize


def norm(x, weight=None, bias=None, eps=1e-6, *, rms=True, residual=None, stats=None):
    """(y, h, (mean, rstd)): y = norm(h) in x's dtype, h = x + residual in x's dtype (x when no residual),
    mean and rstd fp32 over the last dim (mean is 0 for RMSNorm)."""
    # The add in fp32, rounded once to the model's dtype: what a bf16/fp16 add does.
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    if stats is None:
        mean = hf.new_zeros(hf.shape[:-1]) if rms else fdiv(hf.sum(-1), hf.shape[-1])
        centered = hf - mean[..., None]
        var = fdiv((centered * centered).sum(-1), hf.shape[-1])
        # rstd by IEEE sqrt and division, which the kernels also use (not the approximate rsqrt).
        rstd = torch.ones_like(var) / torch.sqrt(var + eps)
    else:
        mean, rstd = stats
    n = (hf - mean[..., None]) * rstd[..., None]
    if weight is not None:
        n = n * weight.float()
    if bias is not None:
        n = n + bias.float()
    return n.to(x.dtype), h, (mean, rstd)


def norm_quant_fp8(x, weight=None, bias=None, eps=1e-6, group_size=0, *, rms=True, residual=None, stats=None):
    """(codes, scales, h, (mean, rstd)): norm as above, then dynamic e4m3 per token (group_size 0) or 1 x g."""
    y, h, stats = norm(x, weight, bias, eps, rms=rms, residual=residual, stats=stats)
    q = quantize(y, "fp8_e4m3", ("group", group_size) if group_size else "token")
    return q.data, q.scale, h, stats
