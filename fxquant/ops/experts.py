"""The experts' ops: grouped GEMMs over rows sorted by expert (fp8, W4A8, weight-only, MXFP8), the sort itself, and the
offsets of experts that run densely."""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.kernels import gemm_int4_fp8, gemm_weight_only
from fxquant.kernels.cast import capability
from fxquant.kernels.gemm_grouped import grouped_fp8_mm, grouped_int4_fp8_mm, grouped_weight_only_mm
from fxquant.kernels.quant_mx import mxfp8_values
from fxquant.numerics import reference as R
from fxquant.ops.declare import define, fake

# The implementations, not the ops: the fallback runs one per expert, and a dispatch each would cost 1-4 us
from fxquant.ops.linear import _linear_mxfp8, _linear_weight_only, _scaled_mm_fp8, _scaled_mm_int4_fp8


def _per_expert(x: Tensor, offs: Tensor, out_features: int, out_dtype: torch.dtype, expert_linear) -> Tensor:
    """The grouped GEMM by its definition, for devices and dtypes no kernel serves: expert_linear(e, rows), a slice
    of x's rows, on each expert's rows; the rows past offs[-1] belong to no expert and are zero."""
    out = x.new_zeros((x.shape[0], out_features), dtype=out_dtype)
    for e, rows in R.expert_rows(offs):  # one host sync: fine where no kernel runs
        out[rows] = expert_linear(e, rows)
    return out


def _check_grouped(x: Tensor, offs: Tensor, w: Tensor):
    if x.dim() != 2 or w.dim() != 3 or offs.shape != (w.shape[0],):
        raise ValueError(f"fxquant: a grouped linear takes x [M, K] sorted by expert, offs [E] and expert weights "
                         f"[E, N, K]; got x {tuple(x.shape)}, offs {tuple(offs.shape)}, w {tuple(w.shape)}")


def _grouped_scaled_mm_fp8(a: Tensor, a_scale: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor,
                           out_dtype: torch.dtype) -> Tensor:
    """The experts' fp8 products over rows sorted by expert (offs: int32 cumulative ends, as grouped_mm takes them):
    e4m3 activations a [M, K] with scales [M, 1], [M, K/128] or one element, and e4m3 experts w [E, N, K] with
    scales [E] (per tensor), [E, N, 1] (per channel) or [E, N/128, K/128] (blocks); fp32 accumulation, one cast."""
    _check_grouped(a, offs, w)
    if a.is_cuda and capability(a.device) >= (8, 9):
        return grouped_fp8_mm(a, a_scale, offs.int(), w, w_scale, out_dtype)
    per_tensor = a_scale.numel() == 1
    return _per_expert(a, offs, w.shape[1], out_dtype, lambda e, rows: _scaled_mm_fp8(
        a[rows], a_scale if per_tensor else a_scale[rows], w[e], w_scale[e], None, out_dtype))


grouped_scaled_mm_fp8 = define("grouped_scaled_mm_fp8(Tensor a, Tensor a_scale, Tensor offs, Tensor w, Tensor w_scale, "
                            "ScalarType out_dtype) -> Tensor", _grouped_scaled_mm_fp8)


@fake("grouped_scaled_mm_fp8")
def _(a, a_scale, offs, w, w_scale, out_dtype):
    return a.new_empty((a.shape[0], w.shape[1]), dtype=out_dtype)


def _grouped_scaled_mm_int4_fp8(a: Tensor, a_scale: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor,
                                w_zero_point: Tensor | None, group_size: int, out_features: int,
                                out_dtype: torch.dtype, w_row_scale: Tensor | None = None) -> Tensor:
    """The experts' W4A8 products over rows sorted by expert: e4m3 activations a [M, K] with per-token scales
    [M, 1], int4 experts w [E, N, K/2] with scales (and zero points, or None: symmetric) [E, N, K/group_size]; each
    group's partial scaled in fp32, one cast. w_row_scale [E, N, 1]: the scales are in the row-scaled form
    (numerics/row_powers_of_two.py), which the GPU's large-M routes multiply row-scaled."""
    _check_grouped(a, offs, w)
    if gemm_int4_fp8.supports(a, group_size, out_dtype) is None:
        return grouped_int4_fp8_mm(a, a_scale, offs.int(), w, w_scale, w_zero_point, out_dtype,
                                   row_scale=w_row_scale)
    pick = lambda t, e: None if t is None else t[e]
    return _per_expert(a, offs, out_features, out_dtype, lambda e, rows: _scaled_mm_int4_fp8(
        a[rows], a_scale[rows], w[e], w_scale[e], pick(w_zero_point, e), None, group_size, out_features, out_dtype))


grouped_scaled_mm_int4_fp8 = define(
    "grouped_scaled_mm_int4_fp8(Tensor a, Tensor a_scale, Tensor offs, Tensor w, Tensor w_scale, Tensor? w_zero_point, "
    "int group_size, int out_features, ScalarType out_dtype, Tensor? w_row_scale=None) -> Tensor",
    _grouped_scaled_mm_int4_fp8)


@fake("grouped_scaled_mm_int4_fp8")
def _(a, a_scale, offs, w, w_scale, w_zero_point, group_size, out_features, out_dtype, w_row_scale=None):
    return a.new_empty((a.shape[0], out_features), dtype=out_dtype)


def _grouped_linear_weight_only(x: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor, w_global_scale: Tensor | None,
                                w_zero_point: Tensor | None, fmt: str, group_size: int, out_features: int) -> Tensor:
    """The experts' linears over rows sorted by expert, with weight-only quantized experts (int8, int4, mxfp4,
    nvfp4, mxfp8 codes [E, N, ...]; NVFP4's global scale [E]), activations untouched."""
    _check_grouped(x, offs, w)
    if gemm_weight_only.supports(x, fmt) is None:
        return grouped_weight_only_mm(x, offs.int(), w, w_scale, fmt, group_size, out_features,
                                      zero_point=w_zero_point, global_scale=w_global_scale)
    pick = lambda t, e: None if t is None else t[e]
    return _per_expert(x, offs, out_features, x.dtype, lambda e, rows: _linear_weight_only(
        x[rows], w[e], w_scale[e], pick(w_global_scale, e), pick(w_zero_point, e), None, fmt, group_size, out_features))


grouped_linear_weight_only = define(
    "grouped_linear_weight_only(Tensor x, Tensor offs, Tensor w, Tensor w_scale, Tensor? w_global_scale, "
    "Tensor? w_zero_point, str fmt, int group_size, int out_features) -> Tensor", _grouped_linear_weight_only)


@fake("grouped_linear_weight_only")
def _(x, offs, w, w_scale, w_global_scale, w_zero_point, fmt, group_size, out_features):
    return x.new_empty((x.shape[0], out_features))


def _grouped_linear_mxfp8(x: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """The experts' linears over rows sorted by expert, MXFP8 activations and experts, as `linear_mxfp8` computes
    each: on CUDA, bf16 activations rounded to their MXFP8 values multiply the decoded codes."""
    _check_grouped(x, offs, w)
    if x.is_cuda and x.dtype == torch.bfloat16 and capability(x.device) >= (8, 9):
        return grouped_weight_only_mm(mxfp8_values(x), offs.int(), w, w_scale, "mxfp8", R.MX_BLOCK, w.shape[1])
    return _per_expert(x, offs, w.shape[1], x.dtype, lambda e, rows: _linear_mxfp8(x[rows], w[e], w_scale[e], None))


grouped_linear_mxfp8 = define("grouped_linear_mxfp8(Tensor x, Tensor offs, Tensor w, Tensor w_scale) -> Tensor",
                           _grouped_linear_mxfp8)


@fake("grouped_linear_mxfp8")
def _(x, offs, w, w_scale):
    return x.new_empty((x.shape[0], w.shape[1]))


def _sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows grouped by expert for the grouped GEMMs: (order, inverse, offs) such that rows[order] are sorted by
    expert id, sorted[inverse] restores the row order, and offs (int32 [num_experts]) holds each expert's cumulative
    end. Ids past the last expert sort last and belong to none. No host sync: a CUDA graph replays it."""
    ids = ids.reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=ids.device)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    return order, inverse, torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)


sort_by_expert = define("sort_by_expert(Tensor ids, int num_experts) -> (Tensor, Tensor, Tensor)", _sort_by_expert)


@fake("sort_by_expert")
def _(ids, num_experts):
    n = ids.numel()
    long = dict(dtype=torch.int64, device=ids.device)
    return ids.new_empty((n,), **long), ids.new_empty((n,), **long), ids.new_empty((num_experts,), dtype=torch.int32)


def _uniform_offsets(x: Tensor, num_experts: int) -> Tensor:
    """offs (int32 [num_experts]) for rows x [num_experts * T, ...] in equal blocks, one per expert: experts run
    densely over every token (Llama4's), so the grouped GEMMs serve them with no sort."""
    per_expert = x.shape[0] // num_experts
    return torch.arange(1, num_experts + 1, device=x.device, dtype=torch.int32) * per_expert


uniform_offsets = define("uniform_offsets(Tensor x, int num_experts) -> Tensor", _uniform_offsets)


@fake("uniform_offsets")
def _(x, num_experts):
    return x.new_empty((num_experts,), dtype=torch.int32)
