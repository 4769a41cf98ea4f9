"""fuse_gemm_norm: an fp8 GEMM whose product feeds only a residual add + norm + fp8 quantizer becomes one op, whose
kernel adds, normalizes and quantizes in the GEMM's epilogue at decode (`kernels/gemm_fp8_norm.py`): the o- and
down-projections of a decode layer and the norms after them, a kernel fewer after each.

Off by default (`enable_passes=("fuse_gemm_norm",)` runs it) until the 32-layer decode step measures it faster.

Pre:  none: it matches fxquant's own ops (after fuse_norm and fuse_linear in the pipeline, which make them; a
linear_fp8, which quantizes its activations in the op, becomes their quantize_fp8 and the fused op). Post:
the norm's users read the fused op's (codes, scales, h). Only row-scaled GEMMs (the kernel takes no block scales),
whose product has the residual stream's dtype and feeds nothing else, with no memory write between the GEMM and the
norm.

    %p = scaled_mm_fp8(%a, %s, %w, %ws, %b, bf16)                       %f = scaled_mm_fp8_add_norm_quant(%a, %s,
    %f = add_norm_quant_fp8(%h, %p, %nw, None, eps, 0, True)       ->       %w, %ws, %b, %h, %nw, None, eps, 0, True)

The product is rounded to its dtype and added as the two ops do, so the residual stream keeps their bits; the
norm's statistics sum in the GEMM's thread layout on a GPU, which may move a code one e4m3 step.
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
FUSED = torch.ops.fxquant.scaled_mm_fp8_add_norm_quant.default


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


class FuseGemmNorm(FxquantPass):
    name = "fuse_gemm_norm"
    optional = True
    on_by_default = False

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        # What fuse_norm replaced (the add, the norm's own nodes) stays until cleanup; dead, it still uses the product.
        modified = eliminate_dead_code(gm.graph)
        epochs = mutation_epochs(gm.graph)
        for norm in list(gm.graph.nodes):
            if norm.target is not NORM:
                continue
            args = arguments(norm)
            for product, stream in ((args["residual"], args["x"]), (args["x"], args["residual"])):
                if (isinstance(product, torch.fx.Node) and product.target in (GEMM, LINEAR) and len(product.users) == 1
                        and product is not stream and epochs[product] == epochs[norm] and _row_scaled(gm, product)
                        and _product_dtype(product) == getattr(fake_value(stream), "dtype", None)):
                    break
            else:
                continue
            with gm.graph.inserting_before(norm):
                fused = gm.graph.call_function(FUSED, (*_operands(gm, product), stream, args["weight"], args["bias"],
                                                       args["eps"], args["group_size"], args["rms"]))
            fused.meta.update(norm.meta)
            norm.replace_all_uses_with(fused)
            gm.graph.erase_node(norm)
            gm.graph.erase_node(product)
            modified = True
        return PassResult(gm, modified)
