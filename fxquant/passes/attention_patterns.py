"""Attention as transformers' eager path spells it, matched from its output back to the cache it reads:

    %s = matmul(%q, repeat_kv(K).transpose(2, 3)) * scale      (or / a constant)
    [%s = tanh(%s / cap) * cap]                                 (Gemma2's logit soft-capping)
    [%s = %s + %mask]
    %p = softmax(%s, dim=-1, dtype=float32).to(%q.dtype)       (casts around the softmax in any number)
    [%p = dropout(%p, p=0.0 or training=False)]
    %o = matmul(%p, repeat_kv(V))

`eager_attention` returns the operands an attention op takes; keys and values are the cache itself where the model
repeats them (`repeat_kv`) or reads them as they are (one query head per KV head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.passes.annotations import fake_value
from fxquant.passes.patterns import repeated_kv
from fxquant.passes.spellings import ADD, DIV, DROPOUT, DTYPE_CASTS, MATMUL, MUL, SOFTMAX, TANH, TRANSPOSE, target_of


@dataclass
class EagerAttention:
    query: torch.fx.Node
    keys: torch.fx.Node  # [B, Hkv, S, D], as the cache holds them
    values: torch.fx.Node
    reads: tuple[torch.fx.Node, torch.fx.Node]  # what the matmuls read: the repeats, or the cache itself
    mask: torch.fx.Node | None
    scale: float
    softcap: float  # 0.0: none


def _arg(node, index, name, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _constant(value) -> bool:
    return isinstance(value, float | int) and not isinstance(value, bool)


def _skip_casts(node):
    """The tensor under any chain of dtype casts (the softmax's upcast and downcast)."""
    while isinstance(node, torch.fx.Node) and target_of(node) in DTYPE_CASTS and len(node.users) == 1:
        node = node.args[0]
    return node


def _without_dropout(node):
    """x where node is dropout(x) that drops nothing (p=0.0 or training=False), else node."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in DROPOUT:
        return node
    training = _arg(node, 2, "train" if node.target is torch.dropout else "training", True)
    return node.args[0] if _arg(node, 1, "p", 0.5) == 0.0 or training is False else node


def _softmax_input(node):
    """x where node is softmax(x) over the last dim, in fp32 or in x's dtype, else None."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in SOFTMAX:
        return None
    value, dim = fake_value(node.args[0]), _arg(node, 1, "dim")
    last = dim == -1 or (isinstance(value, torch.Tensor) and dim == value.dim() - 1)
    return node.args[0] if last and _arg(node, 2, "dtype") in (None, torch.float32) else None


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


def eager_attention(out: torch.fx.Node) -> EagerAttention | None:
    """The eager spelling ending at `out` (the matmul of probabilities and values), or None."""
    if target_of(out) not in MATMUL or len(out.args) != 2:
        return None
    probs, values_read = out.args
    logits = _softmax_input(_skip_casts(_without_dropout(probs)))
    if logits is None:
        return None
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
    return EagerAttention(query, keys, values, (keys_read, values_read), mask, scale, softcap)
