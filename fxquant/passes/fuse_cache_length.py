"""fuse_cache_length: a decode layer's cache length counted in its rotary + cache write op. transformers' StaticCache
layer keeps how many positions it holds in a 0-d tensor (`cumulative_length`), reads it for the positions it writes
at and then grows it; Inductor makes those two a kernel of their own in every layer of every step:

    %p = arange(n) + L;  L.add_(n);  ...;  %q2 = fxquant.rotary_cache_write(q, k, v, cos, sin, %p, K, V)
        ->  %q2 = fxquant.rotary_cache_append(q, k, v, cos, sin, L, K, V)

and over an e4m3 cache (fxquant.FP8StaticCache), whose scales go at arange(n) + L.to(L's device), the same positions:

    %q2 = fxquant.rotary_cache_write_e4m3(q, k, v, cos, sin, %p, %s, K, V, Sk, Sv)
        ->  %q2 = fxquant.rotary_cache_append_e4m3(q, k, v, cos, sin, L, K, V, Sk, Sv)

The op writes at L + 0..n-1 and grows L by n once every row has read it (`kernels.rotary_cache`). Taken only where n
is the op's query positions, the positions feed nothing but the op, L grows by n exactly once, after the positions
are read (before the op, as a full layer grows it, or after, as a sliding layer not yet full does), and nothing else
reads or writes L from the first position read to the op or the growth, whichever is later: the op then reads the
value the positions read and leaves the value the add left. A length read by anything else is left as it is: the
first layer's, from which transformers positions the step's rotary embedding and its mask. Inductor moves each read
next to its first user, here past the op, and would then run the op on a copy of L and copy it back. The pass
matches fxquant's rotary ops, which fuse_rotary_cache makes, and needs no pass before it.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.annotations import fake_value, module_path
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.side_effects import alias_root
from fxquant.passes.spellings import ADD, ARANGE, target_of
from fxquant.passes.state import PipelineState

APPENDED = {torch.ops.fxquant.rotary_cache_write.default: torch.ops.fxquant.rotary_cache_append.default,
            torch.ops.fxquant.rotary_cache_write_e4m3.default: torch.ops.fxquant.rotary_cache_append_e4m3.default}


def _length(node) -> torch.fx.Node | None:
    """L where node is L or L.to(L's device) with L one integer (a 0-d or 1-element integer tensor)."""
    if isinstance(node, torch.fx.Node) and target_of(node) is torch.Tensor.to and len(node.args) == 2 \
            and not node.kwargs:
        moved, node = fake_value(node), node.args[0]
        source = fake_value(node)
        if not (isinstance(moved, torch.Tensor) and isinstance(source, torch.Tensor)
                and (moved.device, moved.dtype) == (source.device, source.dtype)):
            return None
    value = fake_value(node)
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1
            and value.dtype in (torch.int32, torch.int64)):
        return None
    return node


def _count(node) -> int | None:
    """n where node is arange(n) or arange(0, n) (step 1)."""
    if not (isinstance(node, torch.fx.Node) and target_of(node) in ARANGE) or set(node.kwargs) - {"device", "dtype"}:
        return None
    bounds = node.args
    if len(bounds) == 2 and bounds[0] == 0:
        bounds = bounds[1:]
    return bounds[0] if len(bounds) == 1 and isinstance(bounds[0], int) else None


def appended_positions(node) -> tuple[torch.fx.Node, int, list[torch.fx.Node]] | None:
    """(L, n, the nodes computing them) where node is arange(n) + L (either order, L maybe moved to its own
    device): the n positions a cache of length L appends at."""
    if not (isinstance(node, torch.fx.Node) and target_of(node) in ADD and len(node.args) == 2 and not node.kwargs):
        return None
    for counted, length in (node.args, node.args[::-1]):
        n, source = _count(counted), _length(length)
        if n is not None and source is not None:
            return source, n, [node, counted] + ([length] if length is not source else [])
    return None


def _growth(length: torch.fx.Node, n: int) -> torch.fx.Node | None:
    """The one unread L.add_(n) among L's readers; None where there is not exactly one."""
    growths = [user for user in length.users if target_of(user) is torch.Tensor.add_ and user.args == (length, n)
               and not user.kwargs and not user.users]
    return growths[0] if len(growths) == 1 else None


class FuseCacheLength(FxquantPass):
    name = "fuse_cache_length"
    optional = True

    def __init__(self, state: PipelineState | None = None):
        super().__init__()
        self.state = state

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for op in [node for node in gm.graph.nodes if node.target in APPENDED]:
            where = self._fuse(gm.graph, op)
            if where is not None:
                modified = True
                if self.state is not None:
                    self.state.cache_length.append(where)
        return PassResult(gm, modified)  # the positions left unread go with cleanup's dead code

    @staticmethod
    def _fuse(graph: torch.fx.Graph, op: torch.fx.Node) -> str | None:
        """Rewrites op to count the length and returns the module that grew it (its attention), else None."""
        named = arguments(op)
        reads = [named["positions"]] + ([named["scale_positions"]] if "scale_positions" in named else [])
        found = [appended_positions(node) for node in reads]
        query = fake_value(named["q"])
        if None in found or len({(length, n) for length, n, _ in found}) != 1 or not isinstance(query, torch.Tensor):
            return None
        length, n, _ = found[0]
        growth = _growth(length, n)
        if n != query.shape[2] or growth is None or any(set(node.users) != {op} for node in set(reads)):
            return None
        order = {node: i for i, node in enumerate(graph.nodes)}
        computing = {node for _, _, nodes in found for node in nodes}
        if not set(length.users) <= computing | {growth}:
            return None
        first, last = min(order[node] for node in computing), max(order[op], order[growth])
        if not max(order[node] for node in computing) < order[growth]:
            return None
        root = alias_root(length)
        for node in graph.nodes:  # from the first read of L to the op or the growth: nothing else touches L
            if first < order[node] < last and node not in computing and node not in (growth, op) and (
                    node.op == "call_module" or any(alias_root(n) is root for n in node.all_input_nodes)):
                return None
        caches = [value for name, value in named.items() if name not in ("q", "k", "v", "cos", "sin", "positions",
                                                                           "scale_positions")]
        with graph.inserting_before(op):
            fused = graph.call_function(APPENDED[op.target], (named["q"], named["k"], named["v"], named["cos"],
                                                              named["sin"], length, *caches))
        fused.meta.update(op.meta)
        op.replace_all_uses_with(fused)
        where = module_path(growth) or growth.name
        graph.erase_node(op)
        graph.erase_node(growth)
        return where
