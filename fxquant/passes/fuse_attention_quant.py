"""fuse_attention_quant: decode attention whose output feeds only the o-projection's fp8 quantizer becomes one op,
whose kernel quantizes the output as it merges its splits: the high-precision output is never read back, and the
quantizer's launch goes.

Pre: decode_attention and quantize_linear have run (fuse_linear may have). Post: the o-projection's GEMM reads the
fused op's (codes, scales). Only where the output reaches the quantizer through layout ops alone (reshape, view,
transpose, contiguous), each feeding nothing else, laying it out as o.transpose(1, 2).reshape(B, Q, Hq * D), which
is checked by running the chain on the indices of o's elements; and only where the kernel fuses the quantizer's
groups (`kernels.decode_attention.fuses_quantization`). Elsewhere the output stays materialized.

    %o = decode_attention(%q, %k, %v, ...); %x = reshape(contiguous(transpose(%o, 1, 2)), B, Q, -1)
    %y = linear_fp8(%x, %w, %w_s, %b, 0)
        ->  %c = decode_attention_quantize_fp8(%q, %k, %v, ..., 0)
            %y = scaled_mm_fp8(%c[0], %c[1], %w, %w_s, %b, bf16)

and a quantize_fp8(%x, 0) left unfused (int4_fp8's W4A8 GEMM reads it) becomes the op alone. The codes are the
quantizer's bits: the op quantizes the output rounded to its dtype, as the unfused graph stores it. The fused op
runs where the attention ran, so no read of the cache moves past a write.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.decode_attention import fuses_quantization, output_like
from fxquant.passes.annotations import fake_value, node_dtype
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.spellings import CONTIGUOUS, PERMUTE, RESHAPE, TRANSPOSE, UNSQUEEZE, target_of

ATTENTION = torch.ops.fxquant.decode_attention.default
FUSED = torch.ops.fxquant.decode_attention_quantize_fp8.default
LINEAR_FP8 = torch.ops.fxquant.linear_fp8.default
QUANTIZE = torch.ops.fxquant.quantize_fp8.default
# make_fx spells a copying reshape as clone, then _unsafe_view
LAYOUT_OPS = RESHAPE | TRANSPOSE | PERMUTE | UNSQUEEZE | CONTIGUOUS | {torch.ops.aten._unsafe_view.default}


def _attention_rows(x: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(attention, layout nodes from it to x) where x is decode_attention's output o laid out as o.transpose(1,
    2).reshape(B, Q, Hq * D) by layout ops alone, each node feeding only the next; else None."""
    chain, node = [], x
    while isinstance(node, torch.fx.Node) and node.target is not ATTENTION:
        if target_of(node) not in LAYOUT_OPS or len(node.users) != 1:
            return None
        chain.append(node)
        node = node.args[0] if node.args else None
    if not isinstance(node, torch.fx.Node) or len(node.users) != 1:
        return None
    chain.reverse()
    o, laid_out = fake_value(node), fake_value(x)
    if not isinstance(o, torch.Tensor):  # a node made by a pass, without its value: o is shaped as q
        o = fake_value(arguments(node)["q"])
    if not isinstance(o, torch.Tensor) or not isinstance(laid_out, torch.Tensor):
        return None
    shape = tuple(o.shape)
    if not all(isinstance(size, int) for size in shape) or laid_out.shape != (shape[0], shape[2], shape[1] * shape[3]):
        return None
    # o's elements by index, laid out as the op stores o (views in the chain hold only for that layout): the chain
    # must place them as expected
    indices = output_like(torch.empty(shape, dtype=torch.int64)).copy_(torch.arange(o.numel()).reshape(shape))
    for link in chain:
        operands = []
        torch.fx.node.map_arg((link.args[1:], link.kwargs), operands.append)
        if operands:  # a size computed in the graph: not a layout known here
            return None
        indices = target_of(link)(indices, *link.args[1:], **link.kwargs)
    if not torch.equal(indices, torch.arange(o.numel()).reshape(shape).transpose(1, 2).reshape(laid_out.shape)):
        return None
    return node, chain


class FuseAttentionQuant(FxquantPass):
    name = "fuse_attention_quant"
    optional = True

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in list(gm.graph.nodes):
            if node.target not in (LINEAR_FP8, QUANTIZE):
                continue
            named = arguments(node)
            found = _attention_rows(named["x"]) if named["group_size"] >= 0 else None  # per tensor: two passes
            if found is None:
                continue
            attention, chain = found
            if not fuses_quantization(fake_value(arguments(attention)["q"]), named["group_size"]):
                continue
            if node.target is LINEAR_FP8 and node_dtype(named["x"]) is None:
                continue
            graph = gm.graph
            with graph.inserting_before(attention):
                fused = graph.call_function(FUSED, (*attention.args, named["group_size"]), attention.kwargs)
            if node.target is QUANTIZE:
                fused.meta.update(node.meta)
                node.replace_all_uses_with(fused)
            else:
                with graph.inserting_before(node):
                    codes = graph.call_function(operator.getitem, (fused, 0))
                    scales = graph.call_function(operator.getitem, (fused, 1))
                    product = graph.call_function(torch.ops.fxquant.scaled_mm_fp8.default, (
                        codes, scales, named["w"], named["w_scale"], named["bias"], node_dtype(named["x"])))
                product.meta.update(node.meta)
                node.replace_all_uses_with(product)
            for dead in (node, *reversed(chain), attention):
                graph.erase_node(dead)
            modified = True
        return PassResult(gm, modified)
