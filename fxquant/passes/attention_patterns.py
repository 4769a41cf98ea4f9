"""Attention as transformers' eager path spells it, matched from its output back to the cache it reads:

    %s = matmul(%q, repeat_kv(K).transpose(2, 3)) * scale      (or / a constant)
    [%s = tanh(%s / cap) * cap]                                 (Gemma2's logit soft-capping)
    [%s = %s + %mask]
    %p = softmax(%s, dim=-1, dtype=float32).to(%q.dtype)       (casts around the softmax in any number)
    [%p = dropout(%p, p=0.0 or training=False)]
    %o = matmul(%p, repeat_kv(V))

and GPT-OSS's attention sinks, a learned logit per head joined to every row and dropped after the softmax:

    %c = cat([%s, sinks.reshape(1, -1, 1, 1).expand(...)], -1)
    [%c = %c - %c.max(-1, keepdim=True).values]                 (a shift the softmax does not see)
    %p = softmax(%c, dim=-1, ...)[..., :-1]

`eager_attention` returns the operands an attention op takes; keys and values are the cache itself where the model
repeats them (`repeat_kv`) or reads them as they are (one query head per KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.passes.annotations import fake_value
from fxquant.passes.patterns import call_arg, repeated_kv
from fxquant.passes.spellings import (
    ADD,
    AMAX,
    CAT,
    DIV,
    DROPOUT,
    DTYPE_CASTS,
    EXPAND,
    GATHER_ROWS,
    MATMUL,
    MUL,
    RESHAPE,
    SOFTMAX,
    SUB,
    TANH,
    TRANSPOSE,
    target_of,
)


@dataclass
class EagerAttention:
    query: torch.fx.Node
    keys: torch.fx.Node  # [B, Hkv, S, D], as the cache holds them
    values: torch.fx.Node
    reads: tuple[torch.fx.Node, torch.fx.Node]  # what the matmuls read: the repeats, or the cache itself
    mask: torch.fx.Node | None
    scale: float
    softcap: float  # 0.0: none
    sinks: torch.fx.Node | None  # [query heads]: one logit each, in every row's softmax and no value


def _constant(value) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool)


def _skip_casts(node):
    """The tensor under any chain of dtype casts (the softmax's upcast and downcast)."""
    while isinstance(node, torch.fx.Node) and target_of(node) in DTYPE_CASTS and len(node.users) == 1:
        node = node.args[0]
    return node


def without_dropout(node):
    """x where node is dropout(x) that drops nothing (p=0.0 or training=False), else node."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in DROPOUT:
        return node
    training = call_arg(node, 2, "training", "train", default=True)  # F.dropout's name, torch.dropout's
    return node.args[0] if call_arg(node, 1, "p", default=0.5) == 0.0 or training is False else node


def _softmax_input(node):
    """x where node is softmax(x) over the last dim, in any float dtype (the op's softmax, in fp32, is at least as
    accurate), else None."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in SOFTMAX:
        return None
    value, dim = fake_value(node.args[0]), call_arg(node, 1, "dim")
    last = dim == -1 or (isinstance(value, torch.Tensor) and dim == value.dim() - 1)
    floating = (None, torch.float32, torch.bfloat16, torch.float16)
    return node.args[0] if last and call_arg(node, 2, "dtype") in floating else None


def _operand_pair(node, targets):
    """(tensor, constant) where node is one of targets applied to a tensor node and a Python number."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in targets or len(node.args) != 2:
        return None
    a, b = node.args
    if isinstance(a, torch.fx.Node) and _constant(b):
        return a, float(b)
    if targets is MUL and isinstance(b, torch.fx.Node) and _constant(a):
        return b, float(a)
    return None


def _soft_capped(node):
    """(x, cap) where node is tanh(x / cap) * cap, else (node, 0.0)."""
    outer = _operand_pair(node, MUL)
    if outer is not None and target_of(outer[0]) in TANH:
        inner = _operand_pair(outer[0].args[0], DIV)
        if inner is not None and inner[1] == outer[1] > 0:
            return inner[0], outer[1]
    return node, 0.0


def _scaled(node):
    """(x, scale) where node is x * scale or x / c (scale 1 / c), else (node, 1.0)."""
    if (pair := _operand_pair(node, MUL)) is not None:
        return pair
    if (pair := _operand_pair(node, DIV)) is not None and pair[1] != 0:
        return pair[0], 1.0 / pair[1]
    return node, 1.0


def _swapped_last_dims(node):
    """x where node is x.transpose of its last two dims, else None."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in TRANSPOSE:
        return None
    value = fake_value(node.args[0])
    rank = value.dim() if isinstance(value, torch.Tensor) else None
    dims = {d % rank for d in node.args[1:3]} if rank and all(isinstance(d, int) for d in node.args[1:3]) else None
    return node.args[0] if rank == 4 and dims == {2, 3} else None


def _scores(node):
    """(logits, mask) where node is logits + mask, either order, else (node, None)."""
    if isinstance(node, torch.fx.Node) and target_of(node) in ADD and len(node.args) == 2:
        for logits, mask in (node.args, node.args[::-1]):
            if _qk(_scaled(_soft_capped(logits)[0])[0]) is not None and isinstance(mask, torch.fx.Node):
                return logits, mask
    return node, None


def _qk(node):
    """(query, keys read) where node is matmul(query, keys.transpose(2, 3)), else None."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in MATMUL or len(node.args) != 2:
        return None
    keys = _swapped_last_dims(node.args[1])
    return None if keys is None else (node.args[0], keys)


def _cache(node):
    """(the cache, repeats) read by node: repeat_kv's source, or node itself."""
    source, repeats = repeated_kv(node)
    return (source, repeats) if source is not None else (node, 1)


def _without_last_column(node):
    """x where node is x[..., :-1], else None."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in GATHER_ROWS or len(node.args) != 2:
        return None
    index = node.args[1]
    if isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and index[1] == slice(None, -1, None):
        return node.args[0]
    return None


def _unshifted(node):
    """x where node is x - x.max(-1, keepdim=True).values (or amax), else node."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in SUB or len(node.args) != 2:
        return node
    x, top = node.args
    if isinstance(top, torch.fx.Node) and target_of(top) in GATHER_ROWS and top.args[1] == 0:
        top = top.args[0]  # max(...) returns (values, indices)
    reduces = isinstance(top, torch.fx.Node) and target_of(top) in AMAX and top.args[0] is x
    dim = call_arg(top, 1, "dim") if reduces else None
    return x if reduces and dim == -1 and call_arg(top, 2, "keepdim") is True else node


def _with_sinks(node):
    """(logits, sinks) where node is cat([logits, sinks.reshape(1, -1, 1, 1).expand(...)], -1), else None."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in CAT:
        return None
    parts, dim = node.args[0], call_arg(node, 1, "dim", default=0)
    if not isinstance(parts, list | tuple) or len(parts) != 2 or dim not in (-1, 3):
        return None
    logits, expanded = parts
    if not isinstance(expanded, torch.fx.Node) or target_of(expanded) not in EXPAND:
        return None
    shaped = expanded.args[0]
    if not isinstance(shaped, torch.fx.Node) or target_of(shaped) not in RESHAPE:
        return None
    sinks, value, shape = shaped.args[0], fake_value(shaped.args[0]), fake_value(shaped)
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or tuple(shape.shape) != (1, value.shape[0], 1, 1):
        return None
    return logits, sinks


def eager_attention(out: torch.fx.Node) -> EagerAttention | None:
    """The eager spelling ending at `out` (the matmul of probabilities and values), or None."""
    if target_of(out) not in MATMUL or len(out.args) != 2:
        return None
    probs, values_read = out.args
    probs = _skip_casts(without_dropout(_skip_casts(probs)))
    kept = _without_last_column(probs)
    logits = _softmax_input(_skip_casts(kept if kept is not None else probs))
    if logits is None:
        return None
    sinks = None
    if kept is not None:
        joined = _with_sinks(_unshifted(_skip_casts(logits)))
        if joined is None:
            return None
        logits, sinks = joined
    logits, mask = _scores(_skip_casts(logits))
    capped, softcap = _soft_capped(logits)
    scores, scale = _scaled(capped)
    qk = _qk(scores)
    if qk is None:
        return None
    query, keys_read = qk
    (keys, k_repeats), (values, v_repeats) = _cache(keys_read), _cache(values_read)
    if k_repeats != v_repeats:
        return None
    return EagerAttention(query, keys, values, (keys_read, values_read), mask, scale, softcap, sinks)
