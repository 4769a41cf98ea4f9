"""fuse_linear: quantize_fp8 -> scaled_mm_fp8 becomes one fxquant.linear_fp8 op.

Pre:  quantize_linear and fuse_norm have run. Post: where a quantized activation feeds only its GEMM, the pair
is one op, which Inductor sees as a single node. linear_fp8 runs the quantizer and the GEMM back to back:
quantizing inside the GEMM was measured slower on the H200 (every N tile re-quantizes its rows;
docs/decisions/0012-activation-quant-outside-the-gemm.md).

    %q = quantize_fp8(%x, 128); %a = getitem(%q, 0); %s = getitem(%q, 1)
    %y = scaled_mm_fp8(%a, %s, %w_q, %w_s, %b, bf16)                  ->  %y = linear_fp8(%x, %w_q, %w_s, %b, 128)
"""

from __future__ import annotations

import operator

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import node_dtype
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import mutation_epochs


class FuseLinear(FxquantPass):
    name = "fuse_linear"
    optional = True
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified, epochs = False, mutation_epochs(gm.graph)
        for mm in list(gm.graph.nodes):
            if mm.target is not torch.ops.fxquant.scaled_mm_fp8.default:
                continue
            mm_args = arguments(mm)
            a, a_scale = mm_args["a"], mm_args["a_scale"]
            q = a.args[0] if a.target is operator.getitem else None
            if q is None or q.target is not torch.ops.fxquant.quantize_fp8.default or epochs[q] != epochs[mm]:
                continue  # not a quantizer's output, or a write between it and the GEMM (the fused op reads x later)
            if any(user.target is not operator.getitem for user in q.users) or len(a.users) > 1 \
                    or len(a_scale.users) > 1:
                continue  # the activation codes are used elsewhere: keep them materialized
            x, group = arguments(q)["x"], arguments(q)["group_size"]
            if node_dtype(x) not in (None, mm_args["out_dtype"]):
                continue  # linear_fp8 returns x's dtype
            fused_args = (x, mm_args["w"], mm_args["w_scale"], mm_args["bias"], group)
            with gm.graph.inserting_before(mm):
                fused = gm.graph.call_function(torch.ops.fxquant.linear_fp8.default, fused_args)
            fused.meta.update(mm.meta)
            mm.replace_all_uses_with(fused)
            for node in (mm, a, a_scale, q):
                gm.graph.erase_node(node)
            modified = True
        return PassResult(gm, modified)
