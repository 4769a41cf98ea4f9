"""quantize_linear: each annotated linear with a constant weight becomes fxquant ops per the recipe.

Pre:  freeze_params and detect have run. Post: the weight is quantized once, now, into buffers of the
graph module; activations are quantized at run time by an op; the GEMM is an fxquant op. Layers that
cannot or should not be quantized stay as they are, and the report says why.

    %y = linear(%x, %w, %b)   ->  %q = fxquant.quantize_fp8(%x, 128); %a = getitem(%q, 0); %s = getitem(%q, 1)
                                  %y = fxquant.scaled_mm_fp8(%a, %s, %w_q, %w_scale, %b, bf16)      (fp8)
                              ->  %y = fxquant.linear_weight_only(%x, %w_q, %w_scale, ..., "int4", 128, N)
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant import reference as R
from fxquant.config import KEEP, RECIPES, LinearScheme, QuantConfig
from fxquant.metrics import sqnr_db, worst_row_sqnr_db
from fxquant.passes.annotations import annotation, node_dtype

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
QUANTIZED_KEY = "fxquant_quantized"


@dataclass
class LayerRecord:
    """One linear layer, for the report and for re-quantizing a weight that changed after compile."""

    fqn: str
    shape: tuple[int, int]
    recipe: str | None  # None: skipped
    reason: str  # why skipped, or ""
    bytes_before: int
    bytes_after: int
    weight_sqnr: float | None = None  # dB, the quantized weight against the original
    worst_row_sqnr: float | None = None  # dB, its lowest output channel
    source: torch.Tensor | None = None
    version: int = 0
    buffers: tuple[str, ...] = ()
    rows: tuple[int, int, int] | None = None  # merged with siblings: its rows [first, stop) of `of` in the buffers


def quantize_weight(w: torch.Tensor, recipe: str):
    """The recipe's quantized weight (codes, scale, global scale, zero point in one Quantized)."""
    scheme = RECIPES[recipe]
    return R.quantize(w.detach(), scheme.weight_fmt, scheme.weight_granularity)


def weight_skip_reason(w) -> str | None:
    """Why no recipe can take this weight, or None."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return "weight is not a constant 2-D tensor"
    if w.dtype not in FLOAT_DTYPES:
        return f"weight dtype {w.dtype} is not a float"
    return None


def alignment_reason(shape, scheme: LinearScheme) -> str | None:
    n, k = shape
    if k % scheme.k_multiple or n % scheme.n_multiple:
        return (f"alignment: needs K % {scheme.k_multiple} == 0 and N % {scheme.n_multiple} == 0, "
                f"has [N={n}, K={k}]")
    return None


def skip_reason(w, fqn, config: QuantConfig) -> str | None:
    """Why layer fqn stays in high precision under config, or None."""
    reason = weight_skip_reason(w) or config.skip_reason(fqn)
    if reason:
        return reason
    recipe = config.recipe_for(fqn)
    return "layer_recipes keeps it in high precision" if recipe == KEEP else alignment_reason(w.shape, RECIPES[recipe])


def linear_fqn(node: torch.fx.Node) -> str:
    return annotation(node).fqn or node.name


class QuantizeLinear(PassBase):
    def __init__(self, config: QuantConfig):
        super().__init__()
        self.config = config
        self.layers: list[LayerRecord] = []

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in list(gm.graph.nodes):
            found = annotation(node)
            if found is None or found.kind != "linear" or node.meta.get(QUANTIZED_KEY):
                continue
            x, w_node = node.args[0], node.args[1]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            w = fetch_attr(gm, w_node)
            fqn = linear_fqn(node)
            reason = skip_reason(w, fqn, self.config)
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else ()
            before = w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0
            node.meta[QUANTIZED_KEY] = True
            if reason:
                self.layers.append(LayerRecord(fqn, shape, None, reason, before, before))
                continue
            recipe = self.config.recipe_for(fqn)
            q = quantize_weight(w, recipe)
            names = _register(gm, fqn, q)
            with gm.graph.inserting_before(node):
                consts = [gm.graph.get_attr(n) if n else None for n in names]
                out = emit_linear(gm.graph, RECIPES[recipe], x, consts, bias, shape, node_dtype(node) or w.dtype)
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
            w_hat = R.dequantize(q, torch.float32)
            self.layers.append(LayerRecord(fqn, shape, recipe, "", before, q.nbytes, sqnr_db(w_hat, w),
                                           worst_row_sqnr_db(w_hat, w), w, w._version, tuple(names)))
            modified = True
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)


def emit_linear(graph, s: LinearScheme, x, consts, bias, shape, out_dtype):
    """The fxquant ops that compute linear(x, w, bias) from the quantized weight's (data, scale, global scale,
    zero point) nodes; the one place that says which op serves which scheme."""
    data, scale, global_scale, zero_point = consts
    if s.kind == "fp8":
        q = graph.call_function(torch.ops.fxquant.quantize_fp8.default, (x, s.act_group))
        a = graph.call_function(operator.getitem, (q, 0))
        a_scale = graph.call_function(operator.getitem, (q, 1))
        return graph.call_function(torch.ops.fxquant.scaled_mm_fp8.default,
                                   (a, a_scale, data, scale, bias, out_dtype))
    if s.kind == "mxfp8":
        return graph.call_function(torch.ops.fxquant.linear_mxfp8.default, (x, data, scale, bias))
    group = s.weight_granularity[1] if isinstance(s.weight_granularity, tuple) else {
        "mxfp4": R.MX_BLOCK, "nvfp4": R.NVFP4_BLOCK}.get(s.weight_fmt, 0)
    return graph.call_function(torch.ops.fxquant.linear_weight_only.default,
                               (x, data, scale, global_scale, zero_point, bias, s.weight_fmt, group, shape[0]))


def fetch_attr(gm, node):
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def _register(gm, fqn, q) -> list[str | None]:
    """Buffers for (data, scale, global_scale, zero_point); None where the format has no such tensor."""
    base = "_fxq_" + re.sub(r"\W", "_", fqn)
    names = []
    for suffix, tensor in (("qdata", q.data), ("scale", q.scale), ("global_scale", q.global_scale),
                           ("zero_point", q.zero_point)):
        if tensor is None:
            names.append(None)
            continue
        gm.register_buffer(f"{base}_{suffix}", tensor)
        names.append(f"{base}_{suffix}")
    return names
