"""Per-layer error of a recipe on real inputs: weight, activation and output SQNR against an fp32 shadow.

Serves `fxquant.inspect` and recipe="auto", for linears and for MoE expert products. The quantized output is
computed by the same fxquant ops the quantize pass inserts (through `emit_linear`), so what is measured is what
runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from fxquant.config import AUTO, AUTO_LADDER, KEEP, RECIPES, QuantConfig
from fxquant.numerics import reference as R
from fxquant.numerics.granularity import activation_granularity
from fxquant.numerics.metrics import sqnr_db
from fxquant.passes.annotations import annotation, linear_fqn, node_dtype
from fxquant.passes.patterns import ExpertOperands, weight_operands
from fxquant.passes.side_effects import has_side_effects
from fxquant.quantization.linear_ops import emit_linear, emit_routed_linear, run_now
from fxquant.quantization.weight_quantization import (
    CAST_REASON,
    ROUTER_REASON,
    alignment_reason,
    quantize_weight,
    skip_reason,
    weight_skip_reason,
    weight_sqnrs,
)


@dataclass(frozen=True)
class LayerError:
    """One linear layer (or experts' product) under one recipe; SQNRs in dB (inf: exact; None: not applicable or
    not measured)."""

    fqn: str
    shape: tuple[int, ...]
    recipe: str | None  # None: skipped
    reason: str = ""  # why skipped
    weight_sqnr: float | None = None
    act_sqnr: float | None = None
    out_sqnr: float | None = None
    chosen_by_auto: bool = False  # recipe="auto" picked this recipe (or, with recipe None, found none)


@dataclass(frozen=True)
class Routing:
    """How an expert product's rows meet its experts: cumulative row ends per expert (rows sorted by expert), or an
    expert id per row."""

    offs: torch.Tensor | None = None
    ids: torch.Tensor | None = None

    def groups(self):
        """(expert, its rows: a slice or an index) for each expert with rows."""
        if self.offs is not None:
            yield from R.expert_rows(self.offs)
            return
        for e in self.ids.unique().tolist():
            yield e, (self.ids == e).nonzero().squeeze(-1)


def for_each_linear(gm: torch.fx.GraphModule, example_inputs, fn: Callable) -> None:
    """Run gm on real inputs and call fn(node, x, weight [N, K], bias, routing) at every annotated linear with a
    constant weight (routing None), and at every expert product (weight [E, N, K], bias None, its Routing). A graph
    that writes memory (a KV cache) runs on copies of its inputs: measuring leaves the caller's state as it was."""

    # The interpreter frees a value after its last use; a bmm-form expert product's rows and ids are used last by
    # the unsqueeze and the weight gather before it, so they are kept until it runs.
    products = {node: weight_operands(node) for node in gm.graph.nodes
                if getattr(annotation(node), "kind", None) in ("linear", "experts")}
    kept = {operands.x: None for operands in products.values() if isinstance(operands, ExpertOperands)}
    kept.update({operands.ids: None for operands in products.values()
                 if isinstance(operands, ExpertOperands) and operands.ids is not None})

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            operands = products.get(node)
            w = operands.weight_nk(gm) if operands is not None else None
            if isinstance(w, torch.Tensor) and not isinstance(operands, ExpertOperands):
                fn(node, self.env[operands.x], w, self.env.get(operands.bias), None)
            elif isinstance(w, torch.Tensor) and operands.dense:  # x [E, T, K]: each expert over its own rows
                rows = kept[operands.x].reshape(-1, w.shape[-1])
                fn(node, rows, w, None, Routing(torch.ops.fxquant.uniform_offsets(rows, w.shape[0])))
            elif isinstance(w, torch.Tensor):
                routing = Routing(self.env[operands.offs] if operands.offs is not None else None,
                                  kept[operands.ids].reshape(-1) if operands.ids is not None else None)
                fn(node, kept[operands.x], w, None, routing)
            result = super().run_node(node)
            if node in kept:
                kept[node] = result
            return result

    writes = any(has_side_effects(node) for node in gm.graph.nodes if node.op.startswith("call"))
    inputs = [t.clone() if writes and isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) else t
              for t in example_inputs]
    with torch.no_grad():
        Recorder(gm).run(*inputs)


def quantized_linear(q, bias: torch.Tensor | None, recipe: str, out_dtype) -> torch.fx.GraphModule:
    """linear(x, w, bias) under `recipe`, with q = quantize_weight(w, recipe), as the quantize pass would emit it,
    in a one-layer graph module."""
    root, graph = torch.nn.Module(), torch.fx.Graph()
    x = graph.placeholder("x")
    consts = []
    for name, tensor in (("data", q.data), ("scale", q.scale), ("global_scale", q.global_scale),
                         ("zero_point", q.zero_point), ("row_scale", q.row_scale), ("bias", bias)):
        if tensor is not None:
            root.register_buffer(name, tensor)
        consts.append(graph.get_attr(name) if tensor is not None else None)
    out = emit_linear(graph.call_function, RECIPES[recipe], x, consts[:5], consts[5], q.shape[0], out_dtype)
    graph.output(out)
    return torch.fx.GraphModule(root, graph)


def _act_sqnr(x: torch.Tensor, recipe: str) -> float | None:
    scheme = RECIPES[recipe]
    if scheme.kind == "weight_only":
        return None
    if scheme.kind == "mxfp8":
        return sqnr_db(R.dequantize(R.quantize(x, "mxfp8"), torch.float32), x)
    granularity = activation_granularity(scheme.act_group)
    return sqnr_db(R.dequantize(R.quantize(x, "fp8_e4m3", granularity), torch.float32), x)


def measure(fqn: str, x: torch.Tensor, w: torch.Tensor, bias, recipe: str, out_dtype,
            routing: Routing | None = None) -> LayerError:
    """The three SQNRs of one layer (an expert product, given its routing) under `recipe`, on the input x it saw."""
    q = quantize_weight(w, recipe)
    if routing is None:
        w_sqnr = weight_sqnrs(q, w)[0]
        # The shadow: the same layer in fp32 on the same input, so only this layer's quantization is measured.
        shadow = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        out = quantized_linear(q, bias, recipe, out_dtype)(x)
        return LayerError(fqn, tuple(w.shape), recipe, "", w_sqnr, _act_sqnr(x, recipe), sqnr_db(out, shadow))
    w_sqnr = weight_sqnrs(q, w)[0]
    shadow = x.new_zeros((x.shape[0], w.shape[1]), dtype=torch.float32)
    for e, rows in routing.groups():
        shadow[rows] = x[rows].float() @ w[e].float().T
    consts, scheme = (q.data, q.scale, q.global_scale, q.zero_point, q.row_scale), RECIPES[recipe]
    if routing.offs is not None:
        out = emit_linear(run_now, scheme, x, consts, None, w.shape[1], out_dtype, routing.offs)
    else:
        out = emit_routed_linear(run_now, scheme, x, routing.ids, w.shape[0], consts, w.shape[1], out_dtype)
    return LayerError(fqn, tuple(w.shape), recipe, "", w_sqnr, _act_sqnr(x, recipe), sqnr_db(out, shadow))


def measure_graph(gm: torch.fx.GraphModule, example_inputs, config: QuantConfig,
                  usable: tuple[str, ...] = tuple(RECIPES)) -> list[LayerError]:
    """Every linear in gm under the recipe config gives it; recipe="auto" layers get their cheapest `usable`
    recipe that meets config.min_sqnr_db (or none, with the best recipe's numbers in the reason)."""
    ladder = [recipe for recipe in AUTO_LADDER if recipe in usable]
    found: list[LayerError] = []

    def visit(node, x, w, bias, routing):
        fqn, shape, out_dtype = linear_fqn(node), tuple(w.shape), node_dtype(node) or x.dtype
        if annotation(node).router:
            found.append(LayerError(fqn, shape, None, ROUTER_REASON))
            return
        if getattr(weight_operands(node), "cast", False):
            found.append(LayerError(fqn, shape, None, CAST_REASON))
            return
        dims = 2 if routing is None else 3
        unpinned = config.recipe == AUTO and config.layer_recipe(fqn) is None
        if unpinned and not (weight_skip_reason(w, dims) or config.skip_reason(fqn)):
            found.append(_choose(fqn, x, w, bias, config.min_sqnr_db, out_dtype, ladder, routing))
            return
        reason = skip_reason(w, fqn, config, dims=dims)
        found.append(LayerError(fqn, shape, None, reason) if reason else
                     measure(fqn, x, w, bias, config.recipe_for(fqn), out_dtype, routing))

    for_each_linear(gm, example_inputs, visit)
    return found


def _choose(fqn, x, w, bias, floor_db: float, out_dtype, ladder, routing=None) -> LayerError:
    best = None
    for recipe in ladder:
        if alignment_reason(w.shape, RECIPES[recipe]):
            continue
        result = measure(fqn, x, w, bias, recipe, out_dtype, routing)
        if result.out_sqnr >= floor_db:
            return replace(result, chosen_by_auto=True)
        if best is None or result.out_sqnr > best.out_sqnr:
            best = result
    why = f"auto: no recipe reaches {floor_db:g} dB" + (
        f" (best {best.recipe} at {best.out_sqnr:.1f} dB)" if best is not None else " that fits the shape")
    return LayerError(fqn, tuple(w.shape), None, why, chosen_by_auto=True)


def resolve_auto(config: QuantConfig, measured: list[LayerError]) -> QuantConfig:
    """config with each measured auto layer pinned to its chosen recipe (KEEP where none qualified)."""
    pinned = tuple((f"^{re.escape(m.fqn)}$", m.recipe or KEEP) for m in measured if m.chosen_by_auto)
    return replace(config, layer_recipes=config.layer_recipes + pinned)
