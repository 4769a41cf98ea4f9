"""The linear ops: dynamic fp8 activations and the scaled GEMM (quantize_fp8, scaled_mm_fp8, linear_fp8), W4A8
(scaled_mm_int4_fp8, and scaled_mm_int4_fp8_lanes for its M = 1 kernel), weight-only GEMMs (linear_weight_only, and
linear_int4_lanes / linear_fp4_lanes for the 4-bit formats' M = 1 kernels) and MXFP8 (linear_mxfp8)."""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.kernels import (
    cublas_fp8,
    gemm_fp4_mma,
    gemm_int4_fp8,
    gemm_int4_mma,
    gemm_weight_only,
    quant_fp8,
    silu_mul_quant,
)
from fxquant.kernels.cast import capability
from fxquant.kernels.code_tiles import is_tiled, tiled_shape, untile_codes
from fxquant.kernels.gemm_fp4_mma import fp4_lane_layout_shape, fp4_mma_mm
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm, is_block_scaled
from fxquant.kernels.gemm_int4_mma import int4_mma_mm, lane_layout_shape
from fxquant.kernels.quant_mx import mxfp8_values
from fxquant.numerics import reference as R
from fxquant.numerics.granularity import Granularity, activation_granularity
from fxquant.numerics.quantized import Quantized
from fxquant.ops.declare import define, fake
from fxquant.ops.reference_gemm import E4M3, chunked_linear, weight_granularity


def reference_reason(kind: str, fmt: str, act_group: int, group: int, K: int, dtype: torch.dtype) -> str | None:
    """Why a linear quantized as `kind` (a LinearScheme's), with K inputs and `dtype` activations, would compute
    through the pure-torch reference on a GPU rather than its kernels, or None where they serve it. act_group: the
    fp8 activations' (0 per token, -1 per tensor, else a group); group: the weight's (as weight_group gives it)."""
    if kind in ("fp8", "int4_fp8"):
        quantizer = None if act_group < 0 else quant_fp8.row_refusal(act_group or K)
        if quantizer:
            return f"its activation quantizer: {quantizer}"
        return gemm_int4_fp8.shape_refusal(K, group, dtype) if kind == "int4_fp8" else None
    return gemm_weight_only.dtype_refusal(dtype, fmt)  # MXFP8 activations ride the weight-only kernel


def _quantize_fp8(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Dynamic e4m3 codes and fp32 scales of x [..., K]: per token (group_size 0), per 1 x group_size, or
    per tensor (group_size -1, scale of shape [1]). Both contiguous whatever x's layout, as the kernels write them
    (and as the fake says: tests/test_fake_strides.py)."""
    if group_size < 0:
        if x.is_cuda:  # two kernels: amax partials, then scale and codes
            codes, scale = quant_fp8.quantize_fp8_tensor(x, E4M3)
        else:
            q = R.quantize(x, "fp8_e4m3", "tensor")
            codes, scale = q.data.contiguous(), q.scale
        return codes, scale.reshape(1)
    row_len = group_size or x.shape[-1]
    if quant_fp8.supports_rows(x, row_len) is None:
        return quant_fp8.quantize_fp8_rows(x, row_len, E4M3)
    q = R.quantize(x, "fp8_e4m3", activation_granularity(group_size))
    return q.data.contiguous(), q.scale.contiguous()


quantize_fp8 = define("quantize_fp8(Tensor x, int group_size) -> (Tensor, Tensor)", _quantize_fp8)


@fake("quantize_fp8")
def _(x, group_size):
    codes = x.new_empty(x.shape, dtype=E4M3)  # contiguous, whatever x's layout
    if group_size < 0:
        return codes, x.new_empty((1,), dtype=torch.float32)
    groups = x.shape[-1] // group_size if group_size else 1
    return codes, x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def _silu_mul_quantize_fp8(gate: Tensor, up: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """quantize_fp8(silu(gate) * up, group_size), the product computed in fp32 and rounded once to gate's dtype (the
    tensor a gated MLP's unfused graph stores): one kernel on CUDA, where the quantizer's rows kernel serves."""
    row_len = group_size or gate.shape[-1]
    if group_size >= 0 and quant_fp8.supports_rows(gate, row_len) is None:
        return silu_mul_quant.silu_mul_quantize_fp8_rows(gate, up, row_len, E4M3)
    g = gate.float()
    return _quantize_fp8((g * torch.sigmoid(g) * up.float()).to(gate.dtype), group_size)  # silu as x * sigmoid(x)


silu_mul_quantize_fp8 = define("silu_mul_quantize_fp8(Tensor gate, Tensor up, int group_size) -> (Tensor, Tensor)",
                               _silu_mul_quantize_fp8)


@fake("silu_mul_quantize_fp8")
def _(gate, up, group_size):
    return torch.ops.fxquant.quantize_fp8.default(gate, group_size)  # the quantizer's shapes, on gate's


def as_rows(a: Tensor, a_scale: Tensor) -> tuple[Tensor, Tensor]:
    """a [..., K] as the kernels take it, [M, K], and its scales as [M, groups] (or one element, per tensor)."""
    return a.reshape(-1, a.shape[-1]), a_scale.reshape(1) if a_scale.numel() == 1 else a_scale.reshape(
        -1, a_scale.shape[-1])


def _scaled_mm_fp8(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                   out_dtype: torch.dtype) -> Tensor:
    """(a [..., K] * a_scale) @ (w [N, K] * w_scale).T + bias, fp32 accumulation, one cast to out_dtype.

    a_scale: [..., 1] per token or [..., K/g] per 1 x g group; w_scale: one element, [N, 1] or [N/128, K/128].
    """
    lead, K = a.shape[:-1], a.shape[-1]
    a2, s2 = as_rows(a, a_scale)
    if a.is_cuda:
        block = is_block_scaled(s2, w_scale, w.shape[0])
        if cublas_fp8.supports(a2, s2, w, w_scale, bias, out_dtype, block) is None:
            out = cublas_fp8.cublas_scaled_mm(a2, s2, w, w_scale, block)
        else:
            out = fp8_scaled_mm(a2, s2, w, w_scale, bias, out_dtype)
    else:
        group = -1 if s2.dim() == 1 else 0 if s2.shape[1] == 1 else K // s2.shape[1]
        qa = Quantized(a2, s2.reshape(()) if group < 0 else s2, "fp8_e4m3", activation_granularity(group), a2.shape,
                       out_dtype)
        qw = Quantized(w, w_scale, "fp8_e4m3", weight_granularity(w, w_scale), w.shape, out_dtype)
        out = chunked_linear(qa, qw, bias, out_dtype)
    return out.reshape(*lead, w.shape[0])


scaled_mm_fp8 = define("scaled_mm_fp8(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, Tensor? bias, "
                    "ScalarType out_dtype) -> Tensor", _scaled_mm_fp8)


@fake("scaled_mm_fp8")
def _(a, a_scale, w, w_scale, bias, out_dtype):
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=out_dtype)


def _linear_fp8(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None, group_size: int) -> Tensor:
    """F.linear with dynamic e4m3 activations (per token, or 1 x group_size) and a pre-quantized e4m3 weight."""
    # The implementations, not the ops: one dispatch per call instead of three (each 1-4 us of host time).
    a, a_scale = _quantize_fp8(x, group_size)
    return _scaled_mm_fp8(a, a_scale, w, w_scale, bias, x.dtype)


linear_fp8 = define("linear_fp8(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, int group_size) -> Tensor",
                 _linear_fp8)


@fake("linear_fp8")
def _(x, w, w_scale, bias, group_size):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _scaled_mm_int4_fp8(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, w_zero_point: Tensor | None,
                        bias: Tensor | None, group_size: int, out_features: int, out_dtype: torch.dtype,
                        w_row_scale: Tensor | None = None) -> Tensor:
    """(a [..., K] * a_scale [..., 1]) @ (int4 w [N, K/2], or its tiles (`code_tiles`), scales and zero points per
    group_size).T + bias, fp32 accumulation, one cast to out_dtype: W4A8 on the GPU's kernels where they serve, else
    the reference (which untiles tiled codes).
    w_row_scale [N, 1]: the scales are in the row-scaled form (numerics/row_powers_of_two.py), which the GPU's
    large-M route multiplies row-scaled."""
    lead, K = a.shape[:-1], a.shape[-1]
    a2, s2 = a.reshape(-1, K), a_scale.reshape(-1, 1)
    if gemm_int4_fp8.supports(a2, group_size, out_dtype) is None:
        out = gemm_int4_fp8.int4_fp8_mm(a2, s2, w, w_scale, w_zero_point, bias, out_dtype, row_scale=w_row_scale)
    else:
        qa = Quantized(a2, s2, "fp8_e4m3", activation_granularity(0), a2.shape, out_dtype)
        w = untile_codes(w) if is_tiled(w) else w
        qw = Quantized(w, w_scale, "int4", Granularity("group", (group_size,)), torch.Size((out_features, K)),
                       out_dtype, zero_point=w_zero_point)
        out = chunked_linear(qa, qw, bias, out_dtype)
    return out.reshape(*lead, out_features)


scaled_mm_int4_fp8 = define("scaled_mm_int4_fp8(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, "
                            "Tensor? w_zero_point, Tensor? bias, int group_size, int out_features, "
                            "ScalarType out_dtype, Tensor? w_row_scale=None) -> Tensor", _scaled_mm_int4_fp8)


@fake("scaled_mm_int4_fp8")
def _(a, a_scale, w, w_scale, w_zero_point, bias, group_size, out_features, out_dtype, w_row_scale=None):
    return a.new_empty((*a.shape[:-1], out_features), dtype=out_dtype)


def _scaled_mm_int4_fp8_lanes(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, w_zero_point: Tensor | None,
                              lane_scale: Tensor, lane_zero: Tensor | None, bias: Tensor | None, group_size: int,
                              out_features: int, out_dtype: torch.dtype, w_row_scale: Tensor | None = None) -> Tensor:
    """scaled_mm_int4_fp8 for a weight whose scales and zero points are also held in the int4 mma.sync decode
    kernel's per-lane layout (`gemm_int4_mma.pack_lanes`): the rows `gemm_int4_mma.serves_rows` allows, on an sm_89+
    GPU, take that kernel over their e4m3 codes on its fp16 MMA; every other case takes scaled_mm_int4_fp8. The pass
    pack_lanes gives it int4_fp8's linears under the option int4_fp8_lanes."""
    rows = a.reshape(-1, a.shape[-1])
    K = rows.shape[1]
    if (_lanes_serve(rows, w, out_features) and lane_scale.shape == lane_layout_shape(out_features, K, group_size)
            and gemm_int4_mma.supports(rows, group_size) is None):
        out = int4_mma_mm(rows, w.view(torch.int32), lane_scale, lane_zero, group_size, bias,
                          a_scale=a_scale.reshape(-1).float(), out_dtype=out_dtype)
        return out.reshape(*a.shape[:-1], out_features)
    return _scaled_mm_int4_fp8(a, a_scale, w, w_scale, w_zero_point, bias, group_size, out_features, out_dtype,
                               w_row_scale)


scaled_mm_int4_fp8_lanes = define(
    "scaled_mm_int4_fp8_lanes(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, Tensor? w_zero_point, "
    "Tensor lane_scale, Tensor? lane_zero, Tensor? bias, int group_size, int out_features, ScalarType out_dtype, "
    "Tensor? w_row_scale=None) -> Tensor", _scaled_mm_int4_fp8_lanes)


@fake("scaled_mm_int4_fp8_lanes")
def _(a, a_scale, w, w_scale, w_zero_point, lane_scale, lane_zero, bias, group_size, out_features, out_dtype,
      w_row_scale=None):
    return a.new_empty((*a.shape[:-1], out_features), dtype=out_dtype)


def _linear_weight_only(x: Tensor, w: Tensor, w_scale: Tensor, w_global_scale: Tensor | None,
                        w_zero_point: Tensor | None, bias: Tensor | None, fmt: str, group_size: int,
                        out_features: int) -> Tensor:
    """F.linear with a weight-only quantized weight (int8, int4, mxfp4, nvfp4), activations untouched. Packed
    4-bit codes may be tiles (`code_tiles`), which the GPU's kernels read as they are and the reference untiles."""
    in_features = x.shape[-1]
    if gemm_weight_only.supports(x, fmt) is None:
        out = gemm_weight_only.weight_only_mm(x.reshape(-1, in_features), w, w_scale, fmt, group_size,
                                              out_features, zero_point=w_zero_point, global_scale=w_global_scale,
                                              bias=bias)
        return out.reshape(*x.shape[:-1], out_features)
    gran = Granularity("channel") if group_size == 0 else Granularity("group", (group_size,))
    w = untile_codes(w) if is_tiled(w) else w
    qw = Quantized(w, w_scale, fmt, gran, torch.Size((out_features, in_features)), x.dtype,
                   global_scale=w_global_scale, zero_point=w_zero_point)
    out = chunked_linear(x.reshape(-1, in_features), qw, bias, x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


linear_weight_only = define("linear_weight_only(Tensor x, Tensor w, Tensor w_scale, Tensor? w_global_scale, "
                         "Tensor? w_zero_point, Tensor? bias, str fmt, int group_size, int out_features) -> Tensor",
                         _linear_weight_only)


@fake("linear_weight_only")
def _(x, w, w_scale, w_global_scale, w_zero_point, bias, fmt, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _lanes_serve(rows: Tensor, w: Tensor, out_features: int) -> bool:
    """What the mma.sync decode kernels ask of both lanes ops' operands: at most `gemm_int4_mma.serves_rows()`
    activation rows, and packed 4-bit codes as the backend holds them, contiguous rows [N, K / 2] or tiles."""
    K = rows.shape[1]
    stored = tiled_shape(out_features, K) if is_tiled(w) else (out_features, K // 2)
    return rows.shape[0] <= gemm_int4_mma.serves_rows() and w.is_contiguous() and w.shape == stored


def _linear_int4_lanes(x: Tensor, w: Tensor, w_scale: Tensor, w_zero_point: Tensor | None, lane_scale: Tensor,
                       lane_zero: Tensor | None, bias: Tensor | None, group_size: int, out_features: int) -> Tensor:
    """linear_weight_only for an int4 weight whose scales and zero points are also held in the mma.sync decode
    kernel's per-lane layout (`gemm_int4_mma.pack_lanes`). One activation row on the GPU takes that kernel; every
    other case takes linear_weight_only on the row-major scales. At M = 8 the kernel ran 13-34% slower than the
    in-register one on four of five Llama shapes (docs/decisions/0008-int4-mma-lane-packed-scales-at-m1.md), so it
    serves M = 1, or up to 8 rows inside `gemm_int4_mma.serving_up_to` (to time it again). The codes w are rows
    [N, K / 2], or tiles (`code_tiles`), as linear_weight_only takes them."""
    rows = x.reshape(-1, x.shape[-1])
    K = rows.shape[1]
    if (_lanes_serve(rows, w, out_features) and lane_scale.shape == lane_layout_shape(out_features, K, group_size)
            and gemm_int4_mma.supports(rows, group_size) is None):
        out = int4_mma_mm(rows, w.view(torch.int32), lane_scale, lane_zero, group_size, bias)
        return out.reshape(*x.shape[:-1], out_features)
    return _linear_weight_only(x, w, w_scale, None, w_zero_point, bias, "int4", group_size, out_features)


linear_int4_lanes = define("linear_int4_lanes(Tensor x, Tensor w, Tensor w_scale, Tensor? w_zero_point, "
                        "Tensor lane_scale, Tensor? lane_zero, Tensor? bias, int group_size, int out_features) "
                        "-> Tensor", _linear_int4_lanes)


@fake("linear_int4_lanes")
def _(x, w, w_scale, w_zero_point, lane_scale, lane_zero, bias, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_fp4_lanes(x: Tensor, w: Tensor, w_scale: Tensor, w_global_scale: Tensor | None, lane_scale: Tensor,
                      bias: Tensor | None, fmt: str, group_size: int, out_features: int) -> Tensor:
    """linear_weight_only for an MXFP4 or NVFP4 weight whose scales are also held in the mma.sync decode kernel's
    per-lane layout (`gemm_fp4_mma.pack_fp4_lanes`): activation rows up to `gemm_int4_mma.serves_rows()` (one unless
    told otherwise, as for int4) on the GPU take that kernel; every other case takes linear_weight_only on the
    row-major scales. The codes w are rows [N, K / 2], or tiles (`code_tiles`), as linear_weight_only takes them."""
    rows = x.reshape(-1, x.shape[-1])
    K = rows.shape[1]
    if (_lanes_serve(rows, w, out_features) and group_size == gemm_fp4_mma.BLOCKS.get(fmt)
            and lane_scale.shape == fp4_lane_layout_shape(out_features, K, fmt)
            and gemm_fp4_mma.supports(rows, fmt) is None):
        out = fp4_mma_mm(rows, w.view(torch.int32), lane_scale, fmt, w_global_scale, bias)
        return out.reshape(*x.shape[:-1], out_features)
    return _linear_weight_only(x, w, w_scale, w_global_scale, None, bias, fmt, group_size, out_features)


linear_fp4_lanes = define("linear_fp4_lanes(Tensor x, Tensor w, Tensor w_scale, Tensor? w_global_scale, "
                          "Tensor lane_scale, Tensor? bias, str fmt, int group_size, int out_features) -> Tensor",
                          _linear_fp4_lanes)


@fake("linear_fp4_lanes")
def _(x, w, w_scale, w_global_scale, lane_scale, bias, fmt, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_mxfp8(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """MXFP8 activations (dynamic, blocks of 32) and weight. Hopper has no MX tensor cores, but bf16 holds MXFP8
    values exactly (down to 2^-133, below a block scale of 2^-124), so on CUDA bf16 activations are quantized and
    dequantized in one kernel and multiply the weight through the weight-only GEMM, which decodes its codes to bf16:
    the products of the MX operands, accumulated in fp32. Elsewhere (the CPU, fp16 activations, GPUs without fp8
    casts) the reference GEMM runs in fp32."""
    if x.is_cuda and gemm_weight_only.dtype_refusal(x.dtype, "mxfp8") is None and capability(x.device) >= (8, 9):
        out = gemm_weight_only.weight_only_mm(mxfp8_values(x.reshape(-1, x.shape[-1])), w, w_scale, "mxfp8",
                                              R.MX_BLOCK, w.shape[0], bias=bias)
        return out.reshape(*x.shape[:-1], w.shape[0])
    qw = Quantized(w, w_scale, "mxfp8", Granularity("group", (R.MX_BLOCK,)), w.shape, x.dtype)
    out = chunked_linear(x.reshape(-1, x.shape[-1]), qw, bias, x.dtype,
                          lambda rows: R.dequantize(R.quantize(rows, "mxfp8"), torch.float32))
    return out.reshape(*x.shape[:-1], w.shape[0])


linear_mxfp8 = define("linear_mxfp8(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor", _linear_mxfp8)


@fake("linear_mxfp8")
def _(x, w, w_scale, bias):
    return x.new_empty((*x.shape[:-1], w.shape[0]))
