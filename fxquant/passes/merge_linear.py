"""merge_linear: quantized linears that read the same activation become one GEMM on their stacked weights.

Pre:  quantize_linear and fuse_norm have run. Post: identical activation quantizers are one, and sibling GEMMs of
one op with the same activation, the same weight layout and no bias are one op on the weights concatenated along
N, and each former output is a slice of its result. A decode step then streams the weights in fewer, wider GEMMs:
in a Llama layer q/k/v become one and gate/up one, 5 launches (and 5 split-K reduces) become 2. Every output
element is the same dot product with the same scales; only the fp32 summation order may differ with the tiling.
Weights with one scale per tensor are not merged (fp8 per tensor, NVFP4's global scale): their scales differ.
int4 codes in tiles (kernels/code_tiles.py) stack as tiles: every part's N is a multiple of a tile's 64 rows.

    %q = scaled_mm_fp8(%a, %s, %wq, %sq, None, bf16); %k = scaled_mm_fp8(%a, %s, %wk, %sk, None, bf16)
        ->  %qk = scaled_mm_fp8(%a, %s, %w_qk, %s_qk, None, bf16)
            %q = slice(%qk, -1, 0, Nq); %k = slice(%qk, -1, Nq, Nq + Nk)
"""

from __future__ import annotations

import operator
from collections import Counter, defaultdict

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.code_tiles import code_rows
from fxquant.passes.annotations import PARAMETER_KEY, PARTS_KEY, SOURCE_KEY, fake_value, fetch_attr
from fxquant.passes.op_arguments import arguments, with_arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import mutation_epochs
from fxquant.passes.state import LayerRecord, PipelineState, QuantizedBuffers

QUANTIZE = torch.ops.fxquant.quantize_fp8.default
SCALED_MM = torch.ops.fxquant.scaled_mm_fp8.default
WEIGHT_ONLY = torch.ops.fxquant.linear_weight_only.default
# Per op, by its schema's names: the weight's (codes, scale, zero point), and the output width where one is passed.
W4A8 = torch.ops.fxquant.scaled_mm_int4_fp8.default
WEIGHT_ARGS = {SCALED_MM: ("w", "w_scale", None), WEIGHT_ONLY: ("w", "w_scale", "w_zero_point"),
               W4A8: ("w", "w_scale", "w_zero_point", "w_row_scale")}
WIDTH_ARG = {WEIGHT_ONLY: "out_features", W4A8: "out_features"}


class MergeLinear(FxquantPass):
    name = "merge_linear"
    optional = True
    def __init__(self, state: PipelineState):
        super().__init__()
        self.state = state  # its layers' buffer names and rows are updated, so a changed weight re-quantizes in place

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        deduped = _dedupe_quantizers(gm.graph)
        epochs = mutation_epochs(gm.graph)
        readers = Counter(node.target for node in gm.graph.nodes if node.op == "get_attr")
        siblings = defaultdict(list)
        for node in gm.graph.nodes:
            key = _sibling_key(gm, node, epochs[node], readers)
            if key is not None:
                siblings[key].append(node)
        groups = [nodes for nodes in siblings.values() if len(nodes) > 1]
        for nodes in groups:
            self._merge(gm, nodes)
        return PassResult(gm, bool(groups or deduped))

    def _merge(self, gm: torch.fx.GraphModule, nodes: list[torch.fx.Node]) -> None:
        graph, op = gm.graph, nodes[0].target
        first = arguments(nodes[0])
        weight_args = [name for name in WEIGHT_ARGS[op] if name is not None and first[name] is not None]
        old_names = [[arguments(n)[name].target for name in weight_args] for n in nodes]
        widths = [code_rows(fetch_attr(gm, arguments(n)[weight_args[0]])) for n in nodes]
        total = sum(widths)
        new_names = [f"{name}_merged{len(nodes)}" for name in old_names[0]]
        for i, name in enumerate(new_names):
            gm.register_buffer(name, _stacked([getattr(gm, names[i]) for names in old_names]))
        # Sources: the tensors shared beyond this graph (quantize_'s parameters, weight_store's entries), or None
        # where the buffers are this graph's own.
        sources = [[arguments(n)[name].meta.get(SOURCE_KEY) for name in weight_args] for n in nodes]
        with graph.inserting_before(nodes[0]):
            changes = {arg: graph.get_attr(name) for arg, name in zip(weight_args, new_names, strict=True)}
            if sources[0][0] is not None:  # what a copy of the stacked tensors (pack_lanes) must follow
                for i, const in enumerate(changes.values()):
                    const.meta[PARTS_KEY] = tuple(params[i] for params in sources)
            if op in WIDTH_ARG:
                changes[WIDTH_ARG[op]] = total
            merged = graph.call_function(op, with_arguments(nodes[0], **changes))
        key, value = _merged_value(nodes[0], total)
        if value is not None:
            merged.meta[key] = value
        start = 0
        for node, width in zip(nodes, widths, strict=True):
            with graph.inserting_before(node):
                part = graph.call_function(torch.ops.aten.slice.Tensor, (merged, -1, start, start + width))
            part.meta.update(node.meta)
            if value is not None:
                part.meta[key] = value[..., start:start + width]  # the strided view it now is
            node.replace_all_uses_with(part)
            weight_nodes = [arguments(node)[name] for name in weight_args]
            graph.erase_node(node)
            for weight_node in weight_nodes:
                if not weight_node.users:
                    graph.erase_node(weight_node)
            start += width
        renamed = {old: new for names in old_names for old, new in zip(names, new_names, strict=True)}
        for names in old_names:
            for name in names:
                delattr(gm, name)
        self._record(renamed, widths)
        if sources[0][0] is None:
            return
        # The shared tensors (the model's quantize_ parameters, or weight_store's entries) become views of the
        # stacked ones: one copy of each weight remains, a later load_state_dict reaches this graph, and a later
        # graph of the same model finds them stacked already.
        start = 0
        for width, params in zip(widths, sources, strict=True):
            for param, name in zip(params, new_names, strict=True):
                stacked = getattr(gm, name)  # rows in proportion: codes N, int4 tiles N / 64, block scales N / 128
                param.data = stacked[start * stacked.shape[0] // total: (start + width) * stacked.shape[0] // total]
            start += width

    def _record(self, renamed: dict[str, str], widths: list[int]) -> None:
        """Point each merged layer's record at the merged buffers and at its rows in them."""
        layers = self._layers_of(renamed, len(widths))
        if not layers:
            return  # quantize_'s layers: their tensors are the model's parameters, which no record tracks
        start, total = 0, sum(widths)
        for width, layer in zip(widths, layers, strict=True):
            layer.buffers = QuantizedBuffers(*(renamed.get(name, name) if name else None for name in layer.buffers))
            layer.rows = (start, start + width, total)
            start += width

    def _layers_of(self, renamed: dict[str, str], count: int) -> list[LayerRecord]:
        """The merged layers' records, in merge order; none for weights quantize_ quantized (no record)."""
        layers = [layer for layer in self.state.layers if layer.buffers and layer.buffers.data in renamed]
        order = list(renamed)
        layers.sort(key=lambda layer: order.index(layer.buffers.data))
        if layers and len(layers) != count:
            raise RuntimeError(f"fxquant: merge_linear found {len(layers)} layer records for {count} merged GEMMs")
        return layers


def _stacked(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts concatenated along rows; where they already lie back to back in one storage (stacked by an earlier
    graph of the same model), a view of that storage instead of a copy."""
    first, rows = parts[0], sum(part.shape[0] for part in parts)
    offset = first.storage_offset()
    adjacent = all(part.is_contiguous() and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                   for part in parts)
    for part in parts:
        adjacent = adjacent and part.storage_offset() == offset
        offset += part.numel()
    if adjacent:
        return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
    return torch.cat(parts)


def _dedupe_quantizers(graph: torch.fx.Graph) -> bool:
    """One quantize_fp8 per (activation, group): linears on one input that no fused norm quantized (an export
    graph's, or one without a norm) first share their quantized activation, which makes them siblings."""
    kept, modified = {}, False
    epochs = mutation_epochs(graph)
    for node in list(graph.nodes):
        if node.target is not QUANTIZE:
            continue
        first = kept.setdefault((*node.args, epochs[node]), node)
        if first is node:
            continue
        for item in list(node.users):  # getitem(node, i): read first's getitem i instead
            twin = next((u for u in first.users if u.target is operator.getitem and u.args[1] == item.args[1]), None)
            if twin is None:
                item.replace_input_with(node, first)
            else:
                item.replace_all_uses_with(twin)
                graph.erase_node(item)
        graph.erase_node(node)
        modified = True
    return modified


def _merged_value(node: torch.fx.Node, total: int):
    """(meta key, fake value) of the merged GEMM's output, from a sibling's: same leading dims, N = total."""
    key = "val" if "val" in node.meta else "example_value"
    value = fake_value(node)
    if not isinstance(value, torch.Tensor):
        return key, None
    return key, value.new_empty((*value.shape[:-1], total))


def _sibling_key(gm: torch.fx.GraphModule, node: torch.fx.Node, epoch: int, readers: Counter):
    """What GEMMs must share to merge: op, activation (a getitem stands for its source and index), every
    non-weight argument, the weight's layout past its rows, and the mutation epoch (no write between them);
    None where this node cannot merge."""
    op = node.target
    if node.op != "call_function" or op not in WEIGHT_ARGS:
        return None
    args = arguments(node)
    if args["bias"] is not None:
        return None
    if op is WEIGHT_ONLY and args["w_global_scale"] is not None:
        return None  # a global scale per tensor
    weight_nodes = [args[name] for name in WEIGHT_ARGS[op] if name is not None and args[name] is not None]
    if any(readers[w.target] > 1 for w in weight_nodes):
        return None  # its weight serves other calls too (one module called twice): keep its buffers whole
    owners = {"shared" if w.meta.get(SOURCE_KEY) is not None else "graph" if not w.meta.get(PARAMETER_KEY) else None
              for w in weight_nodes}
    if len(owners) != 1 or None in owners:
        return None  # parameters this pass cannot re-point (an exported module's), or a mix of owners
    weights = [fetch_attr(gm, args[name]) if name is not None else None for name in WEIGHT_ARGS[op]]
    codes, scale = weights[0], weights[1]
    if codes is None or scale is None or scale.numel() == 1 or code_rows(codes) % scale.shape[0]:
        return None  # not buffers, or one scale per tensor
    layout = tuple((tuple(t.shape[1:]), t.dtype, code_rows(codes) // t.shape[0]) if t is not None else None
                   for t in weights)
    merged_args = (*WEIGHT_ARGS[op], WIDTH_ARG.get(op))
    fixed = [_source(value) for name, value in args.items() if name not in merged_args]
    return op, layout, tuple(fixed), epoch, owners.pop()


def _source(arg):
    """fuse_norm gives each former quantizer its own getitem of the fused op: getitems of one output index are
    one input. Any other argument stands for itself (a node, or a constant such as a dtype)."""
    if isinstance(arg, torch.fx.Node) and arg.target is operator.getitem and isinstance(arg.args[1], int):
        return arg.args
    return arg
