"""fuse_gemm_epilogue: an fp8 GEMM whose product feeds only the row work after it becomes one op, whose kernel does
that work in the GEMM's epilogue at decode (`kernels/gemm_fp8_epilogue.py`), a kernel fewer each:
- a residual add + norm + fp8 quantizer (the o- and down-projections, and the norms after them);
- SiLU(gate) x up and its per-token fp8 quantizer, gate and up the two halves of the product (the merged gate/up
  projection).

Off by default (`enable_passes=("fuse_gemm_epilogue",)` runs it) until the 32-layer decode step measures it faster.

Pre:  none: it matches fxquant's own ops (after fuse_norm, merge_linear, fuse_silu_mul and fuse_linear in the
pipeline, which make them; a linear_fp8, which quantizes its activations in the op, becomes their quantize_fp8 and
the fused op). Post: the norm's or the SiLU op's users read the fused op's outputs. Only row-scaled GEMMs (the kernel
takes no block scales), whose product feeds nothing else, with no memory write between the GEMM and the row work.

    %p = scaled_mm_fp8(%a, %s, %w, %ws, %b, bf16)             %f = scaled_mm_fp8_add_norm_quant(%a, %s, %w, %ws, %b,
    %f = add_norm_quant_fp8(%h, %p, %nw, None, eps, 0, True)  ->    %h, %nw, None, eps, 0, True)

    %p = scaled_mm_fp8(%a, %s, %w, %ws, %b, bf16)
    %g = slice(%p, -1, 0, I); %u = slice(%p, -1, I, 2I)       ->  %q = scaled_mm_fp8_silu_mul_quantize(%a, %s, %w, %ws,
    %q = silu_mul_quantize_fp8(%g, %u, 0)                             %b, bf16)

The product is rounded to its dtype and added as the two ops do, so the residual stream and SiLU's codes keep their
bits; the norm's statistics sum in the GEMM's thread layout on a GPU, which may move a code one e4m3 step.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import fake_value, fetch_attr, module_path
from fxquant.passes.attention_patterns import without_dropout
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import call_arg
from fxquant.passes.side_effects import eliminate_dead_code, mutation_epochs
from fxquant.passes.state import PipelineState

GEMM = torch.ops.fxquant.scaled_mm_fp8.default
LINEAR = torch.ops.fxquant.linear_fp8.default
NORM = torch.ops.fxquant.add_norm_quant_fp8.default
QUANTIZE = torch.ops.fxquant.quantize_fp8.default
SLICE = torch.ops.aten.slice.Tensor
SILU = torch.ops.fxquant.silu_mul_quantize_fp8.default
FUSED_NORM = torch.ops.fxquant.scaled_mm_fp8_add_norm_quant.default
FUSED_SILU = torch.ops.fxquant.scaled_mm_fp8_silu_mul_quantize.default


def _row_scaled(gm: torch.fx.GraphModule, gemm: torch.fx.Node) -> bool:
    """The GEMM's (`_is_gemm`) weight scales are per channel or per tensor, as every recipe pairs with per-token or
    per-tensor activations (fp8_row, fp8_tensor), not 128x128 blocks. The kernel checks the activations' scales again
    at run time, and runs the two ops where they are 1x128 groups."""
    w, w_scale = (fetch_attr(gm, arguments(gemm)[name]) for name in ("w", "w_scale"))
    return w_scale.numel() == 1 or tuple(w_scale.shape) in ((w.shape[0],), (w.shape[0], 1))


def _product_dtype(gemm: torch.fx.Node) -> torch.dtype | None:
    """The dtype the GEMM's product is stored in: scaled_mm_fp8's out_dtype, linear_fp8's input's."""
    return arguments(gemm)["out_dtype"] if gemm.target is GEMM else getattr(fake_value(gemm), "dtype", None)


def _operands(gm: torch.fx.GraphModule, gemm: torch.fx.Node) -> tuple:
    """(a, a_scale, w, w_scale, bias) of the GEMM; linear_fp8's activations quantized by a quantize_fp8 node first,
    as its op quantizes them."""
    args = arguments(gemm)
    if gemm.target is GEMM:
        return args["a"], args["a_scale"], args["w"], args["w_scale"], args["bias"]
    quantized = gm.graph.call_function(QUANTIZE, (args["x"], args["group_size"]))
    codes, scales = (gm.graph.call_function(operator.getitem, (quantized, i)) for i in (0, 1))
    return codes, scales, args["w"], args["w_scale"], args["bias"]


def _halves(gm: torch.fx.GraphModule, gate, up) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the product whose last dim gate and up take the two halves of, [0, I) and [I, 2I), feeding nothing else; the
    nodes between), or None. The halves as merge_linear slices them, or as a model's chunk(2, dim=-1) splits them."""
    if not all(isinstance(n, torch.fx.Node) and len(n.users) == 1 and not n.kwargs for n in (gate, up)):
        return None
    if gate.target is operator.getitem and up.target is operator.getitem:  # p.chunk(2, dim=-1)[0], [1]
        chunk = gate.args[0]
        if (gate.args[1], up.args[0], up.args[1]) != (0, chunk, 1) or len(chunk.users) != 2 or not (
                chunk.op == "call_method" and chunk.target == "chunk"
                and call_arg(chunk, 1, "chunks") == 2 and call_arg(chunk, 2, "dim", default=0) == -1):
            return None
        product, between = chunk.args[0], [gate, up, chunk]
        return (product, between) if _is_gemm(product) and len(product.users) == 1 else None
    if gate.target is not SLICE or up.target is not SLICE:
        return None
    (product, *g), (other, *u) = gate.args, up.args
    if product is not other or not _is_gemm(product) or len(product.users) != 2:
        return None
    g, u = (tuple(args) + (0, None, None, 1)[len(args):] for args in (g, u))  # dim, start, end, step
    width, n = g[2], fetch_attr(gm, arguments(product)["w"]).shape[0]
    halves = (g[0] == u[0] == -1 and g[1] in (0, None) and isinstance(width, int) and u[1] == width and n == 2 * width
              and (u[2] is None or u[2] >= n) and g[3] == u[3] == 1)
    return (product, [gate, up]) if halves else None


def _is_gemm(node) -> bool:
    """An fp8 GEMM node whose weight is a constant of the graph (its rows and scales are read at compile time)."""
    return (isinstance(node, torch.fx.Node) and node.target in (GEMM, LINEAR)
            and all(isinstance(arguments(node)[name], torch.fx.Node) and arguments(node)[name].op == "get_attr"
                    for name in ("w", "w_scale")))


class FuseGemmEpilogue(FxquantPass):
    name = "fuse_gemm_epilogue"
    optional = True
    on_by_default = False

    def __init__(self, state: PipelineState | None = None):
        super().__init__()
        self.state = state  # where it records each GEMM it fused, for the report

    def _record(self, product: torch.fx.Node, halves=()) -> None:
        """The fused GEMM's layer, by module path; a merged gate/up GEMM by its halves' (merge_linear gave its slices
        the merged layers' places): model.layers.0.mlp.gate_proj+up_proj."""
        if self.state is None:
            return
        paths = [path for path in map(module_path, halves) if path] or [module_path(product) or product.name]
        self.state.gemm_epilogues.append("+".join([paths[0], *(path.rpartition(".")[2] for path in paths[1:])]))

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        # What earlier passes replaced (the add, the norm's own nodes) stays until cleanup; dead, it still uses the
        # product.
        modified = eliminate_dead_code(gm.graph)
        epochs = mutation_epochs(gm.graph)
        for node in list(gm.graph.nodes):
            if node.target is NORM:
                modified |= self._norm(gm, node, epochs)
            elif node.target is SILU:
                modified |= self._silu(gm, node, epochs)
        return PassResult(gm, modified)

    def _norm(self, gm, norm, epochs) -> bool:
        args = arguments(norm)
        for operand, stream in ((args["residual"], args["x"]), (args["x"], args["residual"])):
            product = without_dropout(operand)  # a dropout that drops nothing (Phi-3's residual dropout, in eval)
            if (_is_gemm(product) and len(product.users) == 1 and operand is not stream
                    and (operand is product or len(operand.users) == 1) and epochs[product] == epochs[norm]
                    and _row_scaled(gm, product) and _product_dtype(product) == getattr(fake_value(stream), "dtype",
                                                                                         None)):
                break
        else:
            return False
        with gm.graph.inserting_before(norm):
            fused = gm.graph.call_function(FUSED_NORM, (*_operands(gm, product), stream, args["weight"], args["bias"],
                                                        args["eps"], args["group_size"], args["rms"]))
        fused.meta.update(norm.meta)
        self._record(product)
        norm.replace_all_uses_with(fused)
        for node in dict.fromkeys((norm, operand, product)):  # users first
            gm.graph.erase_node(node)
        return True

    def _silu(self, gm, silu, epochs) -> bool:
        args = arguments(silu)
        found = _halves(gm, args["gate"], args["up"]) if args["group_size"] == 0 else None
        if found is None or epochs[found[0]] != epochs[silu] or not _row_scaled(gm, found[0]):
            return False
        product, between = found
        with gm.graph.inserting_before(silu):
            fused = gm.graph.call_function(FUSED_SILU, (*_operands(gm, product), _product_dtype(product)))
        fused.meta.update(silu.meta)
        self._record(product, between[:2] if between[0].target is SLICE else ())
        silu.replace_all_uses_with(fused)
        for node in (silu, *between, product):  # users first
            gm.graph.erase_node(node)
        return True
