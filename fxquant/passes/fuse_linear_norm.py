"""fuse_linear_norm: a bias-free fp8 linear whose output only feeds a residual add and the norm -> fp8 after it
joins that norm in one op.

Pre:  fuse_norm, fuse_linear and cleanup have run (the adds fuse_norm replaced are gone). Post: in a transformer
layer, o_proj and down_proj each form one op with the next norm -> fp8. Where the GEMM splits K (decode, some
medium M), the norm kernel adds the split-K partials itself: one kernel launch and one round trip of the GEMM's
output fewer, and the same bits as the two ops (`ops.linear_fp8_add_norm_quant`).

    %y = linear_fp8(%x, %w_q, %w_s, None, 128)
    %f = add_norm_quant_fp8(%y, %r, %w, None, eps, 128, True)
        ->  %f = linear_fp8_add_norm_quant(%x, %w_q, %w_s, 128, %r, %w, None, eps, 128, True)
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import annotation
from fxquant.passes.rewrite import replace_with_call

LINEAR = torch.ops.fxquant.linear_fp8.default
ADD_NORM = torch.ops.fxquant.add_norm_quant_fp8.default
FUSED = torch.ops.fxquant.linear_fp8_add_norm_quant.default


def _joins(node) -> bool:
    """A bias-free linear_fp8 read by one node only."""
    return isinstance(node, torch.fx.Node) and node.target is LINEAR and node.args[3] is None and len(node.users) == 1


class FuseLinearNorm(PassBase):
    def __init__(self):
        self.joined: list[str] = []  # the linears now computed with the norm after them (layer names), for the report

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for norm in list(gm.graph.nodes):
            if norm.target is not ADD_NORM:
                continue
            x, residual, weight, bias, eps, group, rms = norm.args
            if not _joins(x):
                if not _joins(residual):
                    continue
                x, residual = residual, x  # the kernel adds in fp32 and rounds once: either order, the same bits
            source, w, w_scale, _, act_group = x.args
            found = annotation(x)
            self.joined.append(found.fqn if found is not None and found.fqn else x.name)
            replace_with_call(gm, norm, FUSED, (source, w, w_scale, act_group, residual, weight, bias, eps, group, rms),
                              dead=(x,))
            modified = True
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)
