"""fuse_silu_mul: a gated MLP's silu(gate) * up feeding only an fp8 activation quantizer becomes one op, which
computes the product and quantizes it in one kernel: the product is never stored, and a launch goes.

Pre:  quantize_linear has run (and merge_linear, whose merged gate/up output the two slices come from; fuse_linear
has not, so the quantizer is still its own node). Post: the down projection's GEMM reads the fused op's (codes,
scales). Only a silu that feeds nothing else, a product that feeds only the quantizer, and no memory write between
them and the quantizer: elsewhere the product stays materialized.

    %g = getitem(%gu, [..., :I]); %u = getitem(%gu, [..., I:])
    %s = silu(%g); %h = mul(%s, %u)                              ->  %q = silu_mul_quantize_fp8(%g, %u, 0)
    %q = quantize_fp8(%h, 0)

The op rounds the product to the activations' dtype once, as the unfused graph stores it; its silu's exp may differ
from Inductor's by an ulp, so fused a product may differ by an ulp of that dtype in a few elements.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import fake_value
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import mutation_epochs
from fxquant.passes.spellings import MUL, SILU, target_of

QUANTIZE = torch.ops.fxquant.quantize_fp8.default


def _gated(product: torch.fx.Node):
    """(silu, gate, up) where product is silu(gate) * up, either order, with the silu feeding nothing else; else
    None."""
    if target_of(product) not in MUL or len(product.args) != 2 or product.kwargs:
        return None
    for silu, up in (product.args, product.args[::-1]):
        if (isinstance(silu, torch.fx.Node) and isinstance(up, torch.fx.Node) and target_of(silu) in SILU
                and len(silu.users) == 1 and not silu.kwargs.get("inplace", False) and len(silu.args) == 1):
            return silu, silu.args[0], up
    return None


def _same_tensor_shape(gate, up) -> bool:
    """gate and up are tensors of one shape and one floating dtype (no broadcast for the kernel to do)."""
    g, u = fake_value(gate), fake_value(up)
    return (isinstance(g, torch.Tensor) and isinstance(u, torch.Tensor) and g.shape == u.shape
            and g.dtype == u.dtype and g.dtype in (torch.bfloat16, torch.float16, torch.float32))


class FuseSiluMul(FxquantPass):
    name = "fuse_silu_mul"
    optional = True

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified, epochs = False, mutation_epochs(gm.graph)
        for q in list(gm.graph.nodes):
            if q.target is not QUANTIZE:
                continue
            product, group = arguments(q)["x"], arguments(q)["group_size"]
            gated = _gated(product) if isinstance(product, torch.fx.Node) and group >= 0 else None
            if gated is None or len(product.users) > 1 or not _same_tensor_shape(*gated[1:]):
                continue
            silu, gate, up = gated
            if not epochs[silu] == epochs[product] == epochs[q]:
                continue  # a write between them: the fused op would read gate and up after it
            with gm.graph.inserting_before(q):
                fused = gm.graph.call_function(torch.ops.fxquant.silu_mul_quantize_fp8.default, (gate, up, group))
            fused.meta.update(q.meta)
            q.replace_all_uses_with(fused)
            for node in (q, product, silu):
                gm.graph.erase_node(node)
            modified = True
        return PassResult(gm, modified)
