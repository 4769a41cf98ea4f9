"""Which fxquant ops compute linear(x, w, bias) for a quantized weight, and an MoE layer's expert products for
quantized experts, in one place for the graph rewrite and for the modules `quantize_` installs: `call(fn, args)`
either adds a node (graph.call_function) or runs the op."""

from __future__ import annotations

import operator

import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.config import LinearScheme
from fxquant.numerics import reference as R


def run_now(fn, args):
    return fn(*args)


def weight_group(s: LinearScheme) -> int:
    """The weight-only op's group size: int4's groups, MX's and NVFP4's fixed blocks, 0 per channel."""
    if isinstance(s.weight_granularity, tuple):
        return s.weight_granularity[1]
    return {"mxfp4": R.MX_BLOCK, "nvfp4": R.NVFP4_BLOCK}.get(s.weight_fmt, 0)


def emit_linear(call, s: LinearScheme, x, consts, bias, out_features: int, out_dtype, offs=None):
    """linear(x, w, bias) from the quantized weight's (data, scale, global scale, zero point, row scale); given
    offs, the experts' grouped product instead: out[r] = x[r] @ w[e].T for rows x [S, K] sorted by expert (offs:
    cumulative ends) and quantized experts w [E, N, K], with no bias."""
    data, scale, global_scale, zero_point, row_scale = consts
    ops, grouped = torch.ops.fxquant, offs is not None
    if s.kind in ("fp8", "int4_fp8"):
        # Quantizer and GEMM stay two ops: fuse_norm folds the quantizer into a norm before it, fuse_linear fuses
        # what remains. Per-token and 1 x 128 scales are per row: sorted experts' rows quantize as one tensor.
        q = call(ops.quantize_fp8.default, (x, s.act_group))
        a, a_scale = call(operator.getitem, (q, 0)), call(operator.getitem, (q, 1))
        if s.kind == "int4_fp8" and grouped:
            return call(ops.grouped_scaled_mm_int4_fp8.default, (a, a_scale, offs, data, scale, zero_point,
                                                                 weight_group(s), out_features, out_dtype, row_scale))
        if s.kind == "int4_fp8":
            return call(ops.scaled_mm_int4_fp8.default, (a, a_scale, data, scale, zero_point, bias, weight_group(s),
                                                         out_features, out_dtype, row_scale))
        if grouped:
            return call(ops.grouped_scaled_mm_fp8.default, (a, a_scale, offs, data, scale, out_dtype))
        return call(ops.scaled_mm_fp8.default, (a, a_scale, data, scale, bias, out_dtype))
    if s.kind == "mxfp8":
        if grouped:
            return call(ops.grouped_linear_mxfp8.default, (x, offs, data, scale))
        return call(ops.linear_mxfp8.default, (x, data, scale, bias))
    codes = (data, scale, global_scale, zero_point)
    if grouped:
        return call(ops.grouped_linear_weight_only.default,
                    (x, offs, *codes, s.weight_fmt, weight_group(s), out_features))
    return call(ops.linear_weight_only.default, (x, *codes, bias, s.weight_fmt, weight_group(s), out_features))


def emit_routed_linear(call, s: LinearScheme, x, ids, num_experts: int, consts, out_features: int, out_dtype):
    """out[r] = x[r] @ w[ids[r]].T, one expert id per row: the rows sorted by expert, the grouped product, and the
    rows put back in their order."""
    order = call(torch.ops.fxquant.sort_by_expert.default, (ids, num_experts))
    rows, inverse, offs = (call(operator.getitem, (order, i)) for i in range(3))
    out = emit_linear(call, s, call(torch.index_select, (x, 0, rows)), consts, None, out_features, out_dtype, offs)
    return call(torch.index_select, (out, 0, inverse))


def emit_dense_experts_linear(call, s: LinearScheme, x, num_experts: int, in_features: int, consts,
                              out_features: int, out_dtype):
    """out[e] = x[e] @ w[e].T for x [E, T, K]: each expert over its own T rows, as Llama4's experts run every
    expert on every token; the grouped product on x as [E * T, K] rows, an expert every T rows. Returns
    [E, T, N]."""
    rows = call(torch.reshape, (x, (-1, in_features)))
    offs = call(torch.ops.fxquant.uniform_offsets.default, (rows, num_experts))
    out = emit_linear(call, s, rows, consts, None, out_features, out_dtype, offs)
    return call(torch.reshape, (out, (num_experts, -1, out_features)))
