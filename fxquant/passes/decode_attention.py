"""decode_attention: attention of a few query positions over a KV cache becomes fxquant's split-KV kernel, which
reads the cache as stored, once per KV head.

Pre: a graph from dynamo or torch.export. Post: where attention reads the cache (through `repeat_kv`, with
enable_gqa=True, or as is), on a device in `devices`, with operands the kernel serves. Two spellings:

    %k = reshape(expand(K[:, :, None], B, Hkv, n, L, D), B, Hkv * n, L, D); %v likewise from V
    %o = sdpa(%q [B, Hkv * n, Q, D], %k, %v, attn_mask=%m, scale=%s)
        ->  %o = fxquant.decode_attention(%q, K, V, %m, %s, 0.0, None, None, None, None)

and transformers' eager attention (`attention_patterns.eager_attention`: the two matmuls around a softmax, with
Gemma2's logit soft-capping and GPT-OSS's attention sinks), which becomes the same op with the cap as its softcap
and the sinks as its sinks.

An e4m3 cache (fxquant.FP8StaticCache) is read through `fxquant.dequantize_kv(codes, scale, dtype)`; attention
over it is handed the codes and scales, so the kernel dequantizes in registers and the high-precision copy goes:

    %k = fxquant.dequantize_kv(C_k, S_k, bf16) [-> repeat_kv]; %v likewise
    %o = sdpa(%q, %k, %v, ...)  ->  %o = fxquant.decode_attention(%q, C_k, C_v, %m, %s, 0.0, None, S_k, S_v, None)

The mask carries what transformers puts in it (left padding, sliding windows, causality among the Q positions),
so a call without a mask is taken only for one query position. Left as they are: prefill (more than
MAX_QUERIES positions), dropout, is_causal, operands the kernel does not serve, and a graph where the cache is
written between the repeat and the attention (the repeat's copy is then what attention must read); a write to
another tensor between them (export orders the value cache's write after the key cache's repeat) is no obstacle.

Given the pipeline's state, the pass records each decode attention it rewrote (`state.decode_attention`) and each
one it left, with why (`state.attention_left`), for the report.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.decode_attention import supports as kernel_supports
from fxquant.passes.annotations import fake_value, module_path
from fxquant.passes.attention_patterns import eager_attention
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import MAX_QUERIES, SDPA_ARGS, repeated_kv
from fxquant.passes.side_effects import Writes
from fxquant.passes.spellings import SDPA
from fxquant.passes.state import PipelineState

ATTENTION = torch.ops.fxquant.decode_attention.default
DEQUANTIZE_KV = torch.ops.fxquant.dequantize_kv.default


@dataclass
class Attention:
    """One attention call's operands, from either spelling."""

    query: torch.fx.Node
    keys: torch.fx.Node  # the cache as the kernel reads it: [B, Hkv, S, D]
    values: torch.fx.Node
    reads: tuple[torch.fx.Node, torch.fx.Node]  # what the attention reads now: repeats, or keys and values as is
    mask: torch.fx.Node | None
    scale: float | None  # None: the default, head dim ** -0.5
    softcap: float
    sinks: torch.fx.Node | None
    refusal: str | None  # an argument the kernel does not take (dropout, is_causal)


def dequantized_codes(node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(codes, scale) where node is fxquant.dequantize_kv(codes, scale, dtype), else None."""
    if isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is DEQUANTIZE_KV:
        named = arguments(node)
        return named["codes"], named["scale"]
    return None


def sdpa_attention(sdpa: torch.fx.Node) -> Attention | None:
    """The operands of an SDPA call over the cache: repeated, with enable_gqa, or as is."""
    args = {**dict(zip(SDPA_ARGS, sdpa.args, strict=False)), **sdpa.kwargs}  # positionals: a prefix of SDPA_ARGS
    (keys, k_rep), (values, v_rep) = repeated_kv(args["key"]), repeated_kv(args["value"])
    if keys is None or values is None or k_rep != v_rep:
        keys, values = args["key"], args["value"]
    refusal = None
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal", False):
        refusal = "dropout or is_causal, which the kernel does not take"
    return Attention(args["query"], keys, values, (args["key"], args["value"]), args.get("attn_mask"),
                     args.get("scale"), 0.0, None, refusal)


def eager_spelled(out: torch.fx.Node) -> Attention | None:
    found = eager_attention(out)
    if found is None:
        return None
    return Attention(found.query, found.keys, found.values, found.reads, found.mask, found.scale, found.softcap,
                     found.sinks, None)


class DecodeAttention(FxquantPass):
    name = "decode_attention"
    optional = True
    def __init__(self, state: PipelineState | None = None, devices: tuple[str, ...] = ("cuda",)):
        super().__init__()
        self.state = state
        self.devices = devices  # where the kernel runs; elsewhere the op's reference would be slower than SDPA

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified, writes = False, Writes(gm.graph)
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            attention = sdpa_attention(node) if node.target in SDPA else eager_spelled(node)
            if attention is None:
                continue
            where = module_path(node) or node.name
            left = self._rewrite(gm.graph, node, attention, writes)
            if left is None:
                modified = True
                if self.state is not None:
                    self.state.decode_attention.append(where)
            elif left and self.state is not None:
                self.state.attention_left.append((where, left))
        return PassResult(gm, modified)  # the repeats and eager chains left unread go with cleanup's dead code

    def _rewrite(self, graph: torch.fx.Graph, out: torch.fx.Node, attention: Attention, writes: Writes) -> str | None:
        """Replaces the attention ending at `out` with the op and returns None; else, graph untouched, returns
        why a decode step's attention was left, or "" for a call that is not one (prefill, another device)."""
        query = fake_value(attention.query)
        if (not isinstance(query, torch.Tensor) or query.dim() != 4 or query.device.type not in self.devices
                or not isinstance(query.shape[2], int) or query.shape[2] > MAX_QUERIES):
            return ""
        if attention.refusal is not None:
            return attention.refusal
        for read, cache in zip(attention.reads, (attention.keys, attention.values), strict=True):
            if read is not cache and writes.reaches([cache], read, out):  # a repeat_kv copy
                return "the cache is written between the repeat and the attention, which must read the copy"
        keys, values = attention.keys, attention.values
        k_codes, v_codes = dequantized_codes(keys), dequantized_codes(values)
        if (k_codes is None) != (v_codes is None):
            return "one of keys and values is read from e4m3 codes, the other not"
        scales = (None, None)
        if k_codes is not None:
            if any(writes.reaches(codes, copy, out) for codes, copy in ((k_codes, keys), (v_codes, values))):
                return "the cache is written between its dequantize and the attention, which must read the copy"
            (keys, k_scale), (values, v_scale) = k_codes, v_codes
            scales = (k_scale, v_scale)
        k, v, mask = (fake_value(n) for n in (keys, values, attention.mask))
        if not all(isinstance(t, torch.Tensor) for t in (k, v)) or k.dim() != 4:
            return "keys or values that are not [B, Hkv, S, D] tensors"
        positions = query.shape[2]
        if mask is None and positions > 1:
            return f"{positions} query positions without a mask, whose causality the kernel would not know"
        if mask is not None and (mask.dim() != 4 or mask.shape[1] not in (1, query.shape[1])
                                 or mask.shape[2] != positions):
            return f"a mask of shape {tuple(mask.shape)}, not [B, 1 or heads, {positions}, S]"
        refusal = kernel_supports(query, k, v, mask)
        if refusal is not None:
            return refusal
        scale = query.shape[-1] ** -0.5 if attention.scale is None else attention.scale
        if not isinstance(scale, float | int):
            return "a scale computed in the graph; the kernel takes a constant"
        with graph.inserting_before(out):
            op = graph.call_function(ATTENTION, (attention.query, keys, values, attention.mask, float(scale),
                                                 float(attention.softcap), attention.sinks, *scales, None))
        op.meta.update(out.meta)
        out.replace_all_uses_with(op)
        graph.erase_node(out)
        return None
