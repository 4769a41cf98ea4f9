"""quantize_linear: each annotated linear with a constant weight, and each MoE expert product over a 3-D parameter,
becomes fxquant ops per the recipe.

Pre:  freeze_params and detect have run. Post: each weight is quantized once, now, into buffers of the graph
module that every linear reading it shares; activations are quantized at run time by an op; the GEMM is an
fxquant op. Layers that cannot or should not be quantized stay as they are, and their record says why:
routers (their output selects experts), names the config skips, unaligned shapes, and weights that something
kept in high precision also reads (a tied lm_head and its embedding keep one high-precision weight).

    %y = linear(%x, %w, %b)   ->  %q = fxquant.quantize_fp8(%x, 128); %a = getitem(%q, 0); %s = getitem(%q, 1)
    %y = addmm(%b, %x, %w_kn)     %y = fxquant.scaled_mm_fp8(%a, %s, %w_q, %w_scale, %b, bf16)      (fp8)
                              ->  %y = fxquant.linear_weight_only(%x, %w_q, %w_scale, ..., "int4", 128, N)
    %y = _grouped_mm(%x, %W.transpose(-2, -1), offs=%offs)  ->  the grouped ops (fxquant.grouped_*) on %x, %offs
    %y = bmm(%W[%ids], %x.unsqueeze(-1))   ->  rows sorted by expert (fxquant.sort_by_expert), grouped, put back

Expert weights [E, N, K] are quantized expert by expert (`reference.quantize_experts`): no scale spans two experts.
int4 codes are held in tiles where the GPU's kernels read them (`weight_store.tiles_chosen`; int4_fp8's under
int4_code_tiles=True), as the one copy the ops read and the backend re-quantizes into.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.config import RECIPES, LinearScheme
from fxquant.passes.annotations import (
    SHARD_KEY,
    SOURCE_KEY,
    annotation,
    fetch_attr,
    linear_fqn,
    module_path,
    node_dtype,
    tensor_identity,
)
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import ExpertOperands, weight_operands
from fxquant.passes.spellings import EMBEDDING, target_of
from fxquant.passes.state import LayerRecord, PipelineState, QuantizedBuffers
from fxquant.quantization.linear_ops import emit_dense_experts_linear, emit_linear, emit_routed_linear
from fxquant.quantization.weight_quantization import (
    ALIGNMENT,
    CAST_REASON,
    ROUTER_REASON,
    SHARD_HINT,
    quantize_and_measure,
    shared_weight_reason,
    skip_reason,
)
from fxquant.quantization.weight_store import shared_quantized, stored_layout, tiles_chosen

QUANTIZED_KEY = "fxquant_quantized"


def _describe(node: torch.fx.Node) -> str:
    """A node that reads a weight, named for a message."""
    found = annotation(node)
    if found is not None and found.kind == "linear":
        return linear_fqn(node)
    kind = "embedding" if target_of(node) in EMBEDDING else str(node.target).rpartition(".")[2]
    return f"{module_path(node) or node.name} ({kind})"


class QuantizeLinear(FxquantPass):
    name = "quantize_linear"
    needs = ("detect",)  # it reads the annotations detect wrote
    def __init__(self, state: PipelineState):
        super().__init__()
        self.state = state

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        readers = defaultdict(list)  # weight identity -> every node that reads it
        for node in gm.graph.nodes:
            value = fetch_attr(gm, node)
            if isinstance(value, torch.Tensor):
                readers[tensor_identity(value)].extend(node.users)
        groups = defaultdict(list)  # weight identity -> the linears that multiply by it
        for node in gm.graph.nodes:
            found = annotation(node)
            if found is None or found.kind not in ("linear", "experts") or node.meta.get(QUANTIZED_KEY):
                continue
            node.meta[QUANTIZED_KEY] = True
            w = fetch_attr(gm, weight_operands(node).weight)
            groups[tensor_identity(w) if isinstance(w, torch.Tensor) else node].append(node)
        modified = False
        for key, nodes in groups.items():
            # A weight's readers besides its products; an expert product reads it through a transpose or a row
            # gather, its own input.
            own = set(nodes) | {n for node in nodes for n in node.all_input_nodes}
            modified |= self._quantize_group(gm, nodes, [r for r in readers.get(key, ()) if r not in own])
        return PassResult(gm, modified)

    def _quantize_group(self, gm, nodes: list[torch.fx.Node], others: list[torch.fx.Node]) -> bool:
        """Quantize the weight `nodes` share, once, unless a reason keeps it in high precision."""
        operands = [weight_operands(node) for node in nodes]
        source = fetch_attr(gm, operands[0].weight)
        w = operands[0].weight_nk(gm)
        fqn = ", ".join(dict.fromkeys(linear_fqn(node) for node in nodes))
        reasons = [self._reason(node, w) for node in nodes]
        kept = [r for r in reasons if r]
        if others:
            kept.append(shared_weight_reason(map(_describe, others)))
        recipes = {self.state.config.recipe_for(linear_fqn(node)) for node in nodes} if not kept else set()
        if len(recipes) > 1 or len({o.transposed for o in operands}) > 1:
            kept.append(f"layers sharing its weight ask for different schemes ({', '.join(sorted(recipes))})")
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else ()
        before = w.numel() * w.element_size() if isinstance(w, torch.Tensor) else 0
        if kept:
            self.state.layers.append(LayerRecord(fqn, shape, None, "; ".join(dict.fromkeys(kept)), before, before))
            return False
        recipe = recipes.pop()
        owner = operands[0].weight.meta.get(SOURCE_KEY)
        # 4-bit weight-only codes in the layout the GPU's kernels read fastest, as the one copy
        # (docs/decisions/0029-int4-codes-held-in-tiles-on-the-gpu.md)
        tiled = tiles_chosen(self.state.config, RECIPES[recipe], w)

        def quantize(weight, name):
            q, *measured = quantize_and_measure(weight, name)
            return stored_layout(q, tiled), *measured

        q, w_sqnr, worst_row = shared_quantized(owner, w, recipe, (operands[0].transposed, tiled), quantize)
        names = _register(gm, fqn, q)
        for node in nodes:
            # Operands read now: a layer applied to its own output (one weight twice in a row) takes the node that
            # replaced the previous application as its input.
            ops = weight_operands(node)
            with gm.graph.inserting_before(node):
                consts = [gm.graph.get_attr(n) if n else None for n in names]
                for const in consts:
                    if const is not None and owner is not None:  # merge_linear may re-point the shared tensor
                        const.meta[SOURCE_KEY] = getattr(gm, const.target)
                out = _emit(gm.graph.call_function, RECIPES[recipe], ops, consts, shape, node_dtype(node) or w.dtype)
            out.meta.update(node.meta)
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
        self.state.layers.append(LayerRecord(fqn, shape, recipe, "", before, q.nbytes, w_sqnr, worst_row, source,
                                             operands[0].transposed, source._version, names, dtype=source.dtype,
                                             device=source.device, tiled=tiled))
        return True

    def _reason(self, node: torch.fx.Node, w) -> str | None:
        if annotation(node).router:
            return ROUTER_REASON
        if getattr(weight_operands(node), "cast", False):
            return CAST_REASON
        dims = 3 if annotation(node).kind == "experts" else 2
        reason = skip_reason(w, linear_fqn(node), self.state.config, self.state.auto_reasons, dims)
        if reason and reason.startswith(ALIGNMENT) and SHARD_KEY in weight_operands(node).weight.meta:
            return f"{reason} {SHARD_HINT}"
        return reason


def _emit(call, scheme: LinearScheme, ops, consts, shape, out_dtype):
    """The fxquant ops computing a linear's or an expert product's node, from the quantized weight's tensors."""
    if not isinstance(ops, ExpertOperands):
        return emit_linear(call, scheme, ops.x, consts, ops.bias, shape[0], out_dtype)
    if ops.dense:
        return emit_dense_experts_linear(call, scheme, ops.x, shape[0], shape[2], consts, shape[1], out_dtype)
    if ops.offs is not None:
        return emit_linear(call, scheme, ops.x, consts, None, shape[1], out_dtype, ops.offs)
    out = emit_routed_linear(call, scheme, ops.x, ops.ids, shape[0], consts, shape[1], out_dtype)
    return call(torch.unsqueeze, (out, -1))  # bmm's [S, N, 1]


def _register(gm, fqn, q) -> QuantizedBuffers:
    """Buffers for the quantized weight's tensors, named after the layer."""
    base = "_fxq_" + re.sub(r"\W", "_", fqn)
    names = []
    for suffix, tensor in (("qdata", q.data), ("scale", q.scale), ("global_scale", q.global_scale),
                           ("zero_point", q.zero_point), ("row_scale", q.row_scale)):
        if tensor is None:
            names.append(None)
            continue
        gm.register_buffer(f"{base}_{suffix}", tensor)
        names.append(f"{base}_{suffix}")
    return QuantizedBuffers(*names)
