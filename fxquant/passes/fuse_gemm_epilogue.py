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
from fxquant.passes.annotations import fake_value, fetch_attr
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import eliminate_dead_code, mutation_epochs

GEMM = torch.ops.fxquant.scaled_mm_fp8.default
LINEAR = torch.ops.fxquant.linear_fp8.default
NORM = torch.ops.fxquant.add_norm_quant_fp8.default
QUANTIZE = torch.ops.fxquant.quantize_fp8.default
SLICE = torch.ops.aten.slice.Tensor
SILU = torch.ops.fxquant.silu_mul_quantize_fp8.default
FUSED_NORM = torch.ops.fxquant.scaled_mm_fp8_add_norm_quant.default
FUSED_SILU = torch.ops.fxquant.scaled_mm_fp8_silu_mul_quantize.default


def _row_scaled(gm: torch.fx.GraphModule, gemm: torch.fx.Node) -> bool:
    """The GEMM's weight scales are per channel or per tensor, as every recipe pairs with per-token or per-tensor
    activations (fp8_row, fp8_tensor), not 128x128 blocks. The kernel checks the activations' scales again at run
    time, and runs the two ops where they are 1x128 groups."""
    w, w_scale = (arguments(gemm)[name] for name in ("w", "w_scale"))
    if not all(isinstance(node, torch.fx.Node) and node.op == "get_attr" for node in (w, w_scale)):
        return False
    w, w_scale = fetch_attr(gm, w), fetch_attr(gm, w_scale)
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


def _halves(gm: torch.fx.GraphModule, gate, up) -> torch.fx.Node | None:
    """The product whose last dim gate and up slice into its two halves, [0, I) and [I, 2I), feeding nothing else; or
    None."""
    if not all(isinstance(n, torch.fx.Node) and n.target is SLICE and len(n.users) == 1 and not n.kwargs
               for n in (gate, up)):
        return None
    (product, *g), (other, *u) = gate.args, up.args
    if product is not other or len(product.users) != 2 or product.target not in (GEMM, LINEAR):
        return None
    g, u = (tuple(args) + (0, None, None, 1)[len(args):] for args in (g, u))  # dim, start, end, step
    weight = arguments(product)["w"]
    if not (isinstance(weight, torch.fx.Node) and weight.op == "get_attr"):
        return None
    width, n = g[2], fetch_attr(gm, weight).shape[0]
    return product if (g[0] == u[0] == -1 and g[1] in (0, None) and isinstance(width, int) and u[1] == width
                       and n == 2 * width and (u[2] is None or u[2] >= n) and g[3] == u[3] == 1) else None


class FuseGemmEpilogue(FxquantPass):
    name = "fuse_gemm_epilogue"
    optional = True
    on_by_default = False

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
        for product, stream in ((args["residual"], args["x"]), (args["x"], args["residual"])):
            if (isinstance(product, torch.fx.Node) and product.target in (GEMM, LINEAR) and len(product.users) == 1
                    and product is not stream and epochs[product] == epochs[norm] and _row_scaled(gm, product)
                    and _product_dtype(product) == getattr(fake_value(stream), "dtype", None)):
                break
        else:
            return False
        with gm.graph.inserting_before(norm):
            fused = gm.graph.call_function(FUSED_NORM, (*_operands(gm, product), stream, args["weight"], args["bias"],
                                                        args["eps"], args["group_size"], args["rms"]))
        fused.meta.update(norm.meta)
        norm.replace_all_uses_with(fused)
        for node in (norm, product):
            gm.graph.erase_node(node)
        return True

    def _silu(self, gm, silu, epochs) -> bool:
        args = arguments(silu)
        gate, up = args["gate"], args["up"]
        product = _halves(gm, gate, up) if args["group_size"] == 0 else None
        if product is None or epochs[product] != epochs[silu] or not _row_scaled(gm, product):
            return False
        with gm.graph.inserting_before(silu):
            fused = gm.graph.call_function(FUSED_SILU, (*_operands(gm, product), _product_dtype(product)))
        fused.meta.update(silu.meta)
        silu.replace_all_uses_with(fused)
        for node in (silu, gate, up, product):
            gm.graph.erase_node(node)
        return True
