"""Which fxquant ops compute linear(x, w, bias) for a quantized weight, in one place for the graph rewrite and for
the modules `quantize_` installs: `call(fn, args)` either adds a node (graph.call_function) or runs the op."""

from __future__ import annotations

import operator

import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant import reference as R
from fxquant.config import LinearScheme


def run_now(fn, args):
    return fn(*args)


def weight_group(s: LinearScheme) -> int:
    """The weight-only op's group size: int4's groups, MX's and NVFP4's fixed blocks, 0 per channel."""
    if isinstance(s.weight_granularity, tuple):
        return s.weight_granularity[1]
    return {"mxfp4": R.MX_BLOCK, "nvfp4": R.NVFP4_BLOCK}.get(s.weight_fmt, 0)


def emit_linear(call, s: LinearScheme, x, consts, bias, out_features: int, out_dtype):
    """linear(x, w, bias) from the quantized weight's (data, scale, global scale, zero point)."""
    data, scale, global_scale, zero_point = consts
    if s.kind == "fp8":
        # Quantizer and GEMM stay two ops: fuse_norm folds the quantizer into a norm before it, fuse_linear fuses
        # what remains.
        q = call(torch.ops.fxquant.quantize_fp8.default, (x, s.act_group))
        a, a_scale = call(operator.getitem, (q, 0)), call(operator.getitem, (q, 1))
        return call(torch.ops.fxquant.scaled_mm_fp8.default, (a, a_scale, data, scale, bias, out_dtype))
    if s.kind == "mxfp8":
        return call(torch.ops.fxquant.linear_mxfp8.default, (x, data, scale, bias))
    return call(torch.ops.fxquant.linear_weight_only.default,
                (x, data, scale, global_scale, zero_point, bias, s.weight_fmt, weight_group(s), out_features))
