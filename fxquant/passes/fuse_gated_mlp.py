"""fuse_gated_mlp: a gated MLP's three fp8 ops (the merged gate/up product, silu(gate) * up with its per-token
quantizer, the down product) become one op, which at decode runs two kernels
(`fxquant.kernels.gated_mlp_fp8`): the product is made in the gate/up GEMM's epilogue and quantized in the down
GEMM's K loop, the three kernels' bits.

Pre:  matches fxquant's own ops, as merge_linear and fuse_silu_mul leave them (the gate/up product one GEMM, its
halves read only by the fused SiLU op; without those passes it finds nothing to do), before fuse_linear (the gate/up
GEMM's quantizer still its own node, or the fused norm's).
Post: the down product's output is the gated_mlp_fp8 op's. Only per-token activations and weights with one scale a
row; only a gate/up product read by its two halves alone, halves read by the SiLU op alone, codes read by the down
product alone, and no memory write between the gate/up product and the down one.

    %gu = scaled_mm_fp8(%a, %s, %w_gu, %s_gu, None, bf16)
    %g = slice(%gu, -1, 0, I); %u = slice(%gu, -1, I, 2I)
    %q = silu_mul_quantize_fp8(%g, %u, 0)
    %y = scaled_mm_fp8(%q[0], %q[1], %w_down, %s_down, %b, bf16)  ->  %y = gated_mlp_fp8(%a, %s, %w_gu, %s_gu,
                                                                                       %w_down, %s_down, %b, bf16)
"""

from __future__ import annotations

import operator

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import fetch_attr
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import mutation_epochs

SCALED_MM = torch.ops.fxquant.scaled_mm_fp8.default
SILU_MUL = torch.ops.fxquant.silu_mul_quantize_fp8.default
SLICE = torch.ops.aten.slice.Tensor


def _read_by_one(node: torch.fx.Node, reader: torch.fx.Node) -> bool:
    return list(node.users) == [reader]


def _codes_of(down: torch.fx.Node) -> torch.fx.Node | None:
    """The per-token SiLU quantizer whose (codes, scales) down reads, and nothing else does; else None."""
    a, a_scale = arguments(down)["a"], arguments(down)["a_scale"]
    if not all(isinstance(n, torch.fx.Node) and n.target is operator.getitem and _read_by_one(n, down)
               for n in (a, a_scale)):
        return None
    q = a.args[0]
    if q is not a_scale.args[0] or q.target is not SILU_MUL or (a.args[1], a_scale.args[1]) != (0, 1):
        return None
    return q if arguments(q)["group_size"] == 0 and len(q.users) == 2 else None


def _halves_of(q: torch.fx.Node) -> torch.fx.Node | None:
    """The gate/up product whose halves [..., :I] and [..., I:] are q's gate and up, read by q alone; else None."""
    gate, up = arguments(q)["gate"], arguments(q)["up"]
    if not all(isinstance(n, torch.fx.Node) and n.target is SLICE and _read_by_one(n, q) for n in (gate, up)):
        return None
    gate_up = gate.args[0]
    if up.args[0] is not gate_up or gate_up.target is not SCALED_MM or len(gate_up.users) != 2:
        return None
    bounds = [tuple(n.args[1:4]) + tuple(n.args[4:] or (1,)) for n in (gate, up)]
    width = 2 * bounds[0][2] if bounds[0][:2] == (-1, 0) else None
    if width is None or bounds != [(-1, 0, width // 2, 1), (-1, width // 2, width, 1)]:
        return None
    return gate_up


def _row_scaled(gm, weight: torch.fx.Node, scale: torch.fx.Node) -> bool:
    """A weight held as e4m3 codes with one scale a row (as the kernels read it)."""
    w, s = fetch_attr(gm, weight), fetch_attr(gm, scale)
    return (w is not None and s is not None and w.dtype == torch.float8_e4m3fn and w.dim() == 2
            and s.numel() == w.shape[0])


class FuseGatedMlp(FxquantPass):
    name = "fuse_gated_mlp"
    optional = True

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified, epochs = False, mutation_epochs(gm.graph)
        for down in list(gm.graph.nodes):
            if down.target is not SCALED_MM:
                continue
            q = _codes_of(down)
            gate_up = _halves_of(q) if q is not None else None
            if gate_up is None or not epochs[gate_up] == epochs[q] == epochs[down]:
                continue  # not the pattern, or a write between: the fused op would read its input after it
            gu, dn = arguments(gate_up), arguments(down)
            if (gu["bias"] is not None or gu["out_dtype"] != dn["out_dtype"]
                    or not _row_scaled(gm, gu["w"], gu["w_scale"]) or not _row_scaled(gm, dn["w"], dn["w_scale"])
                    or fetch_attr(gm, gu["w"]).shape[0] != 2 * fetch_attr(gm, dn["w"]).shape[1]):
                continue
            with gm.graph.inserting_before(down):
                fused = gm.graph.call_function(torch.ops.fxquant.gated_mlp_fp8.default, (
                    gu["a"], gu["a_scale"], gu["w"], gu["w_scale"], dn["w"], dn["w_scale"], dn["bias"],
                    dn["out_dtype"]))
            fused.meta.update(down.meta)
            down.replace_all_uses_with(fused)
            for node in (down, dn["a"], dn["a_scale"], q, arguments(q)["gate"], arguments(q)["up"], gate_up):
                gm.graph.erase_node(node)
            modified = True
        return PassResult(gm, modified)
