"""decode_attention: attention of a few query positions over a KV cache becomes fxquant's split-KV kernel, which
reads the cache as stored, once per KV head.

Pre: a graph from dynamo or torch.export. Post: where attention reads `repeat_kv`'d keys and values (or the cache
itself with enable_gqa=True), on a device in `devices`, with operands the kernel serves:

    %k = reshape(expand(K[:, :, None], B, Hkv, n, L, D), B, Hkv * n, L, D); %v likewise from V
    %o = sdpa(%q [B, Hkv * n, Q, D], %k, %v, attn_mask=%m, scale=%s)
        ->  %o = fxquant.decode_attention(%q, K, V, %m, %s, 0.0, None, None, None, None)

An e4m3 cache (fxquant.FP8StaticCache) is read through `fxquant.dequantize_kv(codes, scale, dtype)`; attention
over it is handed the codes and scales, so the kernel dequantizes in registers and the high-precision copy goes:

    %k = fxquant.dequantize_kv(C_k, S_k, bf16) [-> repeat_kv]; %v likewise
    %o = sdpa(%q, %k, %v, ...)  ->  %o = fxquant.decode_attention(%q, C_k, C_v, %m, %s, 0.0, None, S_k, S_v, None)

The mask carries what transformers puts in it (left padding, sliding windows, causality among the Q positions),
so a call without a mask is taken only for one query position. Left as they are: prefill (more than
MAX_QUERIES positions), dropout, is_causal, operands the kernel does not serve, and a graph where the cache is
written between the repeat and the attention (the repeat's copy is then what attention must read).
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.decode_attention import decode_attention_serves
from fxquant.passes.annotations import fake_value
from fxquant.passes.patterns import SDPA_ARGS, repeated_kv
from fxquant.passes.side_effects import mutation_epochs
from fxquant.passes.spellings import SDPA

MAX_QUERIES = 4  # a decode step, or a few speculative or chunked positions; past that, prefill's kernels win
ATTENTION = torch.ops.fxquant.decode_attention.default
DEQUANTIZE_KV = torch.ops.fxquant.dequantize_kv.default


def dequantized_codes(node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(codes, scale) where node is fxquant.dequantize_kv(codes, scale, dtype), else None."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is DEQUANTIZE_KV:
        return node.args[0], node.args[1]
    return None


class DecodeAttention(PassBase):
    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.devices = devices  # where the kernel runs; elsewhere the op's reference would be slower than SDPA

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified, epochs = False, mutation_epochs(gm.graph)
        for sdpa in list(gm.graph.nodes):
            if sdpa.op == "call_function" and sdpa.target in SDPA and self._rewrite(gm.graph, sdpa, epochs):
                modified = True
        if modified:  # the repeats left unread go with cleanup's dead-code pass
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)

    def _rewrite(self, graph: torch.fx.Graph, sdpa: torch.fx.Node, epochs) -> bool:
        args = {**dict(zip(SDPA_ARGS, sdpa.args, strict=False)), **sdpa.kwargs}
        if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False):
            return False
        if args.get("enable_gqa", False):
            keys, values = args["key"], args["value"]
        else:
            (keys, k_rep), (values, v_rep) = repeated_kv(args["key"]), repeated_kv(args["value"])
            if keys is None or values is None or k_rep != v_rep:
                return False
            if any(epochs[args[name]] != epochs[sdpa] for name in ("key", "value")):
                return False  # a write between the repeat and the attention
        k_codes, v_codes = dequantized_codes(keys), dequantized_codes(values)
        if (k_codes is None) != (v_codes is None):
            return False
        scales = (None, None)
        if k_codes is not None:
            if any(epochs[n] != epochs[sdpa] for n in (keys, values)):
                return False  # a write between the dequantize and the attention: it must read the codes as they were
            (keys, k_scale), (values, v_scale) = k_codes, v_codes
            scales = (k_scale, v_scale)
        query, k, v, mask = (fake_value(n) for n in (args["query"], keys, values, args.get("attn_mask")))
        if not all(isinstance(t, torch.Tensor) for t in (query, k, v)) or query.dim() != 4 or k.dim() != 4:
            return False
        if query.device.type not in self.devices or not isinstance(query.shape[2], int):
            return False
        positions = query.shape[2]
        if positions > MAX_QUERIES or (mask is None and positions > 1):
            return False
        if mask is not None and (mask.dim() != 4 or mask.shape[1] not in (1, query.shape[1])
                                 or mask.shape[2] != positions):
            return False
        if not decode_attention_serves(query, k, v, mask):
            return False
        scale = args.get("scale")
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        if not isinstance(scale, float | int):
            return False
        with graph.inserting_before(sdpa):
            out = graph.call_function(ATTENTION, (args["query"], keys, values, args.get("attn_mask"), float(scale),
                                                  0.0, None, *scales, None))
        out.meta.update(sdpa.meta)
        sdpa.replace_all_uses_with(out)
        graph.erase_node(sdpa)
        return True
