"""The norm ops: RMSNorm or LayerNorm fused with the fp8 quantizer after it, with or without the residual add
before it."""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8 as norm_quant_kernel
from fxquant.kernels.norm_quant_fp8 import supports as norm_quant_supports
from fxquant.numerics import reference_norm as RN
from fxquant.ops.declare import define, fake
from fxquant.ops.reference_gemm import E4M3


def _norm_quant(x, residual, weight, bias, eps, group_size, rms):
    if x.is_cuda and norm_quant_supports(x.shape[-1], group_size) is None:
        codes, scales, h, _ = norm_quant_kernel(x, weight, bias, eps, group_size, rms=rms, residual=residual)
        return codes, scales, h
    codes, scales, h, _ = RN.norm_quant_fp8(x, weight, bias, eps, group_size, rms=rms, residual=residual)
    # contiguous whatever x's layout, as the kernel writes them and the fakes say
    return codes.contiguous(), scales.contiguous(), None if h is None else h.contiguous()


def _norm_quant_fp8(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group_size: int,
                    rms: bool) -> tuple[Tensor, Tensor]:
    """RMSNorm (rms) or LayerNorm of x [..., D], rounded to x's dtype, then dynamic e4m3 per token
    (group_size 0) or 1 x group_size: (codes, fp32 scales), as quantize_fp8(norm(x)) gives them."""
    codes, scales, _ = _norm_quant(x, None, weight, bias, eps, group_size, rms)
    return codes, scales


norm_quant_fp8 = define("norm_quant_fp8(Tensor x, Tensor? weight, Tensor? bias, float eps, int group_size, bool rms) "
                     "-> (Tensor, Tensor)", _norm_quant_fp8)


@fake("norm_quant_fp8")
def _(x, weight, bias, eps, group_size, rms):
    groups = x.shape[-1] // group_size if group_size else 1
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def _add_norm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                        group_size: int, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """h = x + residual (in x's dtype), then norm_quant_fp8(h): (codes, scales, h)."""
    return _norm_quant(x, residual, weight, bias, eps, group_size, rms)


add_norm_quant_fp8 = define("add_norm_quant_fp8(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
                         "int group_size, bool rms) -> (Tensor, Tensor, Tensor)", _add_norm_quant_fp8)


@fake("add_norm_quant_fp8")
def _(x, residual, weight, bias, eps, group_size, rms):
    groups = x.shape[-1] // group_size if group_size else 1
    return (x.new_empty(x.shape, dtype=E4M3), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32),
            x.new_empty(x.shape))
