"""pack_gqa: decode attention runs on the key/value heads, without repeating them for every query head.

Pre: a graph from dynamo or torch.export. Post: where one query position attends through `repeat_kv`'d keys and
values, the query heads that share a key/value head become that head's query rows, and attention reads the cache as
is:

    %k = reshape(expand(K[:, :, None], B, Hkv, n, L, D), B, Hkv * n, L, D); %v likewise from V
    %o = sdpa(%q [B, Hkv * n, 1, D], %k, %v, attn_mask=%m)
        ->  %o = reshape(sdpa(reshape(%q, B, Hkv, n, D), K, V, attn_mask=%m'), B, Hkv * n, 1, D)

Every query row still takes its softmax over the same keys and mask: with one query position, the rows of a
group differ only in their head. The mask keeps its shape where it is shared by all heads ([b, 1, 1, L]); a mask
per head ([b, Hkv * n, 1, L]) is regrouped like the query. The repeated copies cost more than the attention they
feed: at batch 16 over a 1056-token cache, 8 KV heads repeated 4 times write 277 MB per layer and step.
transformers packs the query the same way in eager decode (`pack_gqa`), but repeats the keys and values under
torch.compile. Prefill (several query positions, whose causal rows differ), causal or dropout calls, and batches
of fewer than MIN_KV_GROUPS (batch, KV head) groups are left as they are, and so is a graph where the cache is
written between the repeat and the attention.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

from fxquant.passes.annotations import fake_value
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import SDPA_ARGS, repeated_kv
from fxquant.passes.side_effects import Writes
from fxquant.passes.spellings import SDPA

# Packed, attention runs one (batch, KV head) group per program: below 16 groups the H200's cuDNN kernel took ~30 us
# however few they were, and the repeat was cheaper (8 KV heads at batch 1: 26.0 us repeated against 30.0 packed;
# 1 KV head at batch 4: 17.2 against 30.0). From 16 groups on, packing won at every point measured: 1.35x at 8 KV
# heads and batch 2, 5.1x at batch 16, 1.44x at 1 KV head and batch 16 (docs/decisions/0011-pack-gqa-from-16-groups.md).
MIN_KV_GROUPS = 16


class PackGQA(FxquantPass):
    name = "pack_gqa"
    optional = True
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified, writes = False, Writes(gm.graph)
        for sdpa in list(gm.graph.nodes):
            if sdpa.op == "call_function" and sdpa.target in SDPA and _pack(gm.graph, sdpa, writes):
                modified = True
        return PassResult(gm, modified)  # the repeats left unread go with cleanup's dead-code pass


def _pack(graph: torch.fx.Graph, sdpa: torch.fx.Node, writes: Writes) -> bool:
    """Rewrite one attention call as the module docstring shows; False (graph untouched) where it does not match."""
    args = {**dict(zip(SDPA_ARGS, sdpa.args, strict=False)), **sdpa.kwargs}  # positionals: a prefix of SDPA_ARGS
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False) or args.get("enable_gqa", False):
        return False
    (keys, k_rep), (values, v_rep) = repeated_kv(args["key"]), repeated_kv(args["value"])
    query, mask = fake_value(args["query"]), fake_value(args.get("attn_mask"))
    if keys is None or values is None or k_rep != v_rep or not isinstance(query, torch.Tensor) or query.dim() != 4:
        return False
    if writes.reaches([keys], args["key"], sdpa) or writes.reaches([values], args["value"], sdpa):
        return False  # a write between the repeat and the attention: the repeat's copy is what attention must read
    batch, heads, positions, dim = query.shape
    if not all(isinstance(size, int) for size in query.shape) or positions != 1:
        return False
    kv_heads = heads // k_rep
    if batch * kv_heads < MIN_KV_GROUPS:
        return False
    if args.get("attn_mask") is not None and (  # the cache length (last dim) may be symbolic: a growing cache
            not isinstance(mask, torch.Tensor) or mask.dim() != 4
            or not all(isinstance(size, int) for size in mask.shape[:3])
            or mask.shape[1] not in (1, heads) or mask.shape[2] != 1):
        return False
    key = "val" if "val" in sdpa.meta else "example_value"
    with graph.inserting_before(sdpa):
        kwargs = {name: args[name] for name in ("attn_mask", "scale") if name in args}
        if kwargs.get("attn_mask") is not None and mask.shape[1] == heads:  # one mask row per head: regroup it
            kwargs["attn_mask"] = graph.call_method("reshape", (args["attn_mask"], mask.shape[0], kv_heads, k_rep, -1))
            kwargs["attn_mask"].meta[key] = mask.new_empty((mask.shape[0], kv_heads, k_rep, mask.shape[3]))
        grouped = graph.call_method("reshape", (args["query"], batch, kv_heads, k_rep, dim))
        attended = graph.call_function(sdpa.target, (grouped, keys, values), kwargs)
        out = graph.call_method("reshape", (attended, batch, heads, 1, dim))
    grouped.meta[key] = attended.meta[key] = query.new_empty((batch, kv_heads, k_rep, dim))
    out.meta.update(sdpa.meta)
    sdpa.replace_all_uses_with(out)
    graph.erase_node(sdpa)
    return True
