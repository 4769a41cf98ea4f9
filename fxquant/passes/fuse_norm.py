"""fuse_norm: a norm whose output feeds only fp8 activation quantizers becomes one norm -> fp8 op; a residual
add feeding that norm joins it.

Pre:  quantize_linear has run (fuse_linear has not). Post: the quantizers read the fused op's (codes, scales);
the add's other users read the fused op's sum. Forms matched, each with or without upcast's fp32 casts:
F.rms_norm / torch.rms_norm / aten.rms_norm, F.layer_norm / aten.layer_norm, and a hand-written RMSNorm
(transformers' LlamaRMSNorm: h.to(f32) -> pow(2).mean(-1) + eps -> rsqrt -> mul -> .to(dtype) -> weight *).

    %h = add(%x, %r)                                 %f = add_norm_quant_fp8(%x, %r, %w, None, eps, 128, True)
    %n = rms_norm(_to_copy(%h, f32), [D], %w, eps)   ->  %q = %f (getitem 0, 1: codes, scales)
    %q = quantize_fp8(_to_copy(%n, bf16), 128)         users of %h read getitem(%f, 2)

The kernel rounds the norm's output to the model's dtype once, where the graph has it; the hand-written form
rounds twice (before and after its weight multiply) and uses an approximate rsqrt, so fused it may differ by
an ulp of the model's dtype in a few elements.
"""

from __future__ import annotations

import operator

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import annotation, module_path, node_dtype
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import match_rms_variance
from fxquant.passes.side_effects import mutation_epochs
from fxquant.passes.spellings import ADD, CASTS, LAYER_NORM, MUL, RMS_NORM, RSQRT, target_of
from fxquant.passes.state import PipelineState

QUANTIZE = torch.ops.fxquant.quantize_fp8.default
VALUE_META = ("val", "example_value", "tensor_meta")
FP32_EPS = torch.finfo(torch.float32).eps  # eps=None: torch's norms then use the fp32 compute dtype's eps


def _uncast(node):
    """The tensor a chain of dtype casts started from."""
    while isinstance(node, torch.fx.Node) and target_of(node) in CASTS:
        node = node.args[0]
    return node


def _arg(node, index, name, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _library_norm(node):
    """(x, weight, bias, eps, rms) of an rms_norm / layer_norm node, inputs before any upcast cast."""
    found = annotation(node)
    if found is None or found.kind not in ("rms_norm", "layer_norm") or target_of(node) not in RMS_NORM | LAYER_NORM:
        return None
    rms = found.kind == "rms_norm"
    weight = _uncast(_arg(node, 2, "weight"))
    bias = None if rms else _uncast(_arg(node, 3, "bias"))
    eps = _arg(node, 3 if rms else 4, "eps", default=None if rms else 1e-5)
    return _uncast(node.args[0]), weight, bias, FP32_EPS if eps is None else eps, rms


def _hand_rms_norm(out):
    """(x, weight, None, eps, True) if `out` is weight * (h32 * rsqrt(mean(h32^2) + eps)).to(dtype), else None."""
    if target_of(out) not in MUL or len(out.args) != 2:
        return None
    for weight, scaled in (out.args, out.args[::-1]):
        normed = _uncast(scaled)
        if not isinstance(normed, torch.fx.Node) or target_of(normed) not in MUL or normed is scaled:
            continue
        h32, rstd = normed.args if target_of(normed.args[1]) in RSQRT else normed.args[::-1]
        if target_of(rstd) not in RSQRT or not isinstance(rstd.args[0], torch.fx.Node):
            continue
        inner = rstd.args[0]
        if target_of(inner) in ADD:
            inner = next((a for a in inner.args if isinstance(a, torch.fx.Node)), None)
        power = inner.args[0] if isinstance(inner, torch.fx.Node) and inner.args else None
        matched = match_rms_variance(power) if isinstance(power, torch.fx.Node) else None
        if matched is None or matched.rsqrt is not rstd or _uncast(power.args[0]) is not _uncast(h32):
            continue
        if isinstance(weight, torch.fx.Node):
            return _uncast(h32), weight, None, matched.eps, True
    return None


def _between(x, out, order) -> set:
    """The nodes computing `out` from `x`: those reached walking back from out, until x."""
    seen, stack = set(), [out]
    while stack:
        for node in stack.pop().all_input_nodes:
            if node not in seen and order[node] > order[x]:
                seen.add(node)
                stack.append(node)
    return seen


def _residual_add(x, norm_out, order):
    """x = add(a, b) of two same-shaped tensors whose users outside the norm all come after it, or None."""
    if target_of(x) not in ADD or len(x.args) != 2 or x.kwargs.get("alpha", 1) != 1:
        return None
    a, b = x.args
    if not all(isinstance(t, torch.fx.Node) for t in (a, b)):
        return None
    same = [getattr(t.meta.get("val", t.meta.get("example_value")), "shape", None) for t in (a, b, x)]
    if same[0] is None or not (same[0] == same[1] == same[2]) or node_dtype(a) != node_dtype(b):
        return None
    inside = _between(x, norm_out, order)
    if any(order[user] < order[norm_out] and user not in inside for user in x.users):
        return None
    return a, b


def _placed(node, epochs, order):
    """A pure node just inserted: the epoch of the node after it, and a position between its neighbours."""
    epochs[node] = epochs[node.next]
    order[node] = (order[node.prev] + order[node.next]) / 2
    return node


class FuseNorm(FxquantPass):
    name = "fuse_norm"
    optional = True
    needs = ("detect",)  # it matches the norms detect annotated
    def __init__(self, state: PipelineState):
        super().__init__()
        self.state = state

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        graph, modified = gm.graph, False
        # Computed once, then kept for the nodes each fusion inserts: recomputing them per norm cost time
        # quadratic in the layers. A fusion adds and removes only pure nodes, so no other node's epoch moves.
        epochs = mutation_epochs(graph)
        order = {node: i for i, node in enumerate(graph.nodes)}
        for out in list(graph.nodes):
            if out.graph is not graph:  # erased by an earlier fusion
                continue
            quantizers = self._quantizers(out)
            if not quantizers:
                continue
            norm_node = _uncast(out)
            found = _library_norm(norm_node) or _hand_rms_norm(out)
            if found is None:
                continue
            x, weight, bias, eps, rms = found
            if node_dtype(x) != node_dtype(out):
                continue  # the norm changes dtype: the kernel's output rounding would not be the graph's
            group = arguments(quantizers[0])["group_size"]
            if epochs[x] != epochs[quantizers[0]]:
                continue  # a write between the norm's input and its quantizers: the fused op may not move past it
            residual = _residual_add(x, out, order)
            # Right after the norm's output: every user after the norm (another norm of the same sum, placed
            # before this norm's quantizers, as in parallel attention and MLP blocks) can then read the fused sum.
            with graph.inserting_before(out.next):
                if residual:
                    fused = _placed(graph.call_function(torch.ops.fxquant.add_norm_quant_fp8.default,
                                                        (*residual, weight, bias, float(eps), group, rms)),
                                    epochs, order)
                    summed = _placed(graph.call_function(operator.getitem, (fused, 2)), epochs, order)
                    # The sum is x itself, recomputed: its shape and dtype records carry over (a later fusion
                    # of the next norm reads them).
                    summed.meta.update({k: v for k, v in x.meta.items() if k in VALUE_META})
                    # Users after the norm read the fused sum; the norm's own nodes go dead with it.
                    after = order[out]
                    x.replace_all_uses_with(summed, delete_user_cb=lambda user, after=after, order=order:
                                            order[user] > after)
                else:
                    fused = _placed(graph.call_function(torch.ops.fxquant.norm_quant_fp8.default,
                                                        (x, weight, bias, float(eps), group, rms)), epochs, order)
            for quantizer in quantizers:
                quantizer.replace_all_uses_with(fused)
                graph.erase_node(quantizer)
            where = norm_node if target_of(norm_node) in RMS_NORM | LAYER_NORM else out
            self.state.fused_norms.append(module_path(where) or where.name)
            modified = True
        return PassResult(gm, modified)  # the norm's own nodes are dead now; cleanup drops them

    @staticmethod
    def _quantizers(out):
        """The quantize_fp8 nodes reading `out`, if they are all its users and share one group (not per tensor)."""
        users = list(out.users)
        if not users or any(u.target is not QUANTIZE for u in users):
            return []
        groups = {arguments(u)["group_size"] for u in users}
        return users if len(groups) == 1 and min(groups) >= 0 else []
