"""The gated MLP op: down(quantize_fp8(silu(gate) * up)) after the merged gate/up fp8 product, as
`fuse_gated_mlp` writes it (gated_mlp_fp8)."""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.kernels import gated_mlp_fp8 as kernels
from fxquant.ops.declare import define, fake
from fxquant.ops.linear import _scaled_mm_fp8, _silu_mul_quantize_fp8, as_rows

DECODE_ROWS = 16  # the fp8 GEMM's decode tiles (gemm_configs): one row tile of every token


def refusal(a: Tensor, a_scale: Tensor, w_gu: Tensor, s_gu: Tensor, w_down: Tensor, s_down: Tensor,
            bias: Tensor | None, out_dtype: torch.dtype) -> str | None:
    """Why the two-GEMM kernels (`kernels.gated_mlp_fp8`) do not run this MLP, or None where they do: decode rows
    (at most 16 tokens) of per-token e4m3 codes on CUDA, e4m3 weights with one scale a row, no bias, bf16 or fp16
    out. Elsewhere the op runs the three ops it replaced."""
    M = a.shape[0]
    if not a.is_cuda:
        return "it runs on CUDA devices (the CPU takes the three ops)"
    if M > DECODE_ROWS:
        return f"{M} rows: its kernels are decode's, for at most {DECODE_ROWS}"
    if bias is not None or out_dtype not in (torch.bfloat16, torch.float16):
        return "a bias on the down product, or an output other than bf16 or fp16"
    rows = a_scale.shape == (M, 1) and s_gu.numel() == w_gu.shape[0] and s_down.numel() == w_down.shape[0]
    if not rows or w_gu.shape[0] % 2 or w_down.shape[1] != w_gu.shape[0] // 2:
        return "scales other than per token and per channel, or weights whose widths do not chain"
    return None


def _gated_mlp_fp8(a: Tensor, a_scale: Tensor, w_gu: Tensor, s_gu: Tensor, w_down: Tensor, s_down: Tensor,
                   bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """scaled_mm_fp8(*silu_mul_quantize_fp8(gate, up, 0), w_down, s_down, bias) where [gate | up] =
    scaled_mm_fp8(a, a_scale, w_gu, s_gu, None): the same bits either way it runs."""
    a2, s2 = as_rows(a, a_scale)
    if refusal(a2, s2, w_gu, s_gu, w_down, s_down, bias, out_dtype) is None:
        out = kernels.down_from_rows_fp8(*kernels.silu_mul_rows_fp8(a2, s2, w_gu, s_gu, out_dtype), w_down, s_down)
        return out.reshape(*a.shape[:-1], w_down.shape[0])
    gate_up = _scaled_mm_fp8(a, a_scale, w_gu, s_gu, None, out_dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    return _scaled_mm_fp8(*_silu_mul_quantize_fp8(gate, up, 0), w_down, s_down, bias, out_dtype)


gated_mlp_fp8 = define("gated_mlp_fp8(Tensor a, Tensor a_scale, Tensor w_gu, Tensor s_gu, Tensor w_down, "
                       "Tensor s_down, Tensor? bias, ScalarType out_dtype) -> Tensor", _gated_mlp_fp8)


@fake("gated_mlp_fp8")
def _(a, a_scale, w_gu, s_gu, w_down, s_down, bias, out_dtype):
    return a.new_empty((*a.shape[:-1], w_down.shape[0]), dtype=out_dtype)
