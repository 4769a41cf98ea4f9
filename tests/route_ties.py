"""Routing ties in a fake-quantized copy's decode: where an MoE router's choice between its last chosen expert and the
first one left out turns on less than rounding, either expert is a correct implementation's choice, so the bound
(hf_models.within_bound) also takes the exact copy's decode with that one choice flipped.

A tie is a token whose top-k margin, the gap between the router logits ranked k and k + 1 in the exact copy, is at
most TIE_FACTOR times how far the plain copy's logits of that router call lie from the exact copy's (the most that
rounding moved any of them). Routers of the softmax -> top-k -> normalize form (Mixtral's, Qwen2-MoE's and Qwen3-MoE's)
are read and flipped, each tie alone and all of them at once; a model without them has no ties. The hooks run
eagerly even inside a dynamo trace (a graph break at each router): they count router calls, which a trace would bake
into its graph.
"""

import contextlib

import hf_models
import torch
import transformers as T

TOPK_ROUTERS = (T.models.mixtral.modeling_mixtral.MixtralTopKRouter,
                T.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter,
                T.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter)
TIE_FACTOR = 2  # a flip moves two logits toward each other by the margin, each at most as far as rounding moves one
MOST_FLIPS = 8  # the ties with the smallest margins, each its own alternative decode


def _normalizes(router: torch.nn.Module) -> bool:
    return getattr(router, "norm_topk_prob", True)  # Mixtral's router always normalizes its top-k


def flipped(router: torch.nn.Module, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor, token: int):
    """(scores, indices) as `router` gave them, but for token its last chosen expert replaced by the most probable one
    it left out (the lowest index among equals, as top-k breaks ties), the token's weights as the router weights its
    choices: the other choice of a tie."""
    probs = torch.softmax(logits[token].float(), dim=-1)
    chosen = indices[token].clone()
    left_out = probs.clone()
    left_out[chosen] = -1.0
    chosen[-1] = left_out.argmax()
    weights = probs[chosen]
    if _normalizes(router):
        weights = weights / weights.sum()
    scores, indices = scores.clone(), indices.clone()
    scores[token], indices[token] = weights.to(scores.dtype), chosen
    return scores, indices


@contextlib.contextmanager
def routers_hooked(model: torch.nn.Module, flips: frozenset = frozenset()):
    """Yields the list of every top-k router call's logits (fp32, in call order) while `model` runs; flips: the
    (call, token) pairs whose choice is flipped (`flipped`)."""
    calls = []

    @torch._dynamo.disable  # run eagerly under a trace too: dynamo would bake the count of calls into its graph
    def hook(router, inputs, output):
        logits, scores, indices = output
        calls.append(logits.detach().float().clone())
        for call, token in flips:
            if call == len(calls) - 1:
                scores, indices = flipped(router, logits, scores, indices, token)
        return logits, scores, indices

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TOPK_ROUTERS)]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def ties(exact_calls: list, plain_calls: list, top_k: int) -> list[tuple[float, int, int]]:
    """(margin, call, token) of each tie, smallest margin first."""
    found = []
    for call, (exact, plain) in enumerate(zip(exact_calls, plain_calls, strict=True)):
        spread = float((exact - plain).abs().max())
        ranked = exact.sort(dim=-1, descending=True).values
        margins = ranked[:, top_k - 1] - ranked[:, top_k]
        for token in (margins <= TIE_FACTOR * spread).nonzero().flatten().tolist():
            found.append((float(margins[token]), call, token))
    return sorted(found)


def alternatives(decode, exact_model, plain_model) -> list[torch.Tensor]:
    """The exact copy's decodes with each tie flipped, and with all of them at once; decode(model) -> [steps, B, V]
    runs a copy, eagerly or traced."""
    if not any(isinstance(m, TOPK_ROUTERS) for m in exact_model.modules()):
        return []
    with routers_hooked(exact_model) as exact_calls:
        decode(exact_model)
    with routers_hooked(plain_model) as plain_calls:
        decode(plain_model)
    top_k = next(m for m in exact_model.modules() if isinstance(m, TOPK_ROUTERS)).top_k
    found = [(call, token) for _, call, token in ties(exact_calls, plain_calls, top_k)[:MOST_FLIPS]]
    flips = [frozenset({tie}) for tie in found] + ([frozenset(found)] if len(found) > 1 else [])
    decoded = []
    for flip in flips:
        with routers_hooked(exact_model, flip):
            decoded.append(decode(exact_model))
    return decoded


def within_bound(got, exact, plain, eager, decode, exact_model, plain_model) -> list[str]:
    """hf_models.within_bound of got against the copies' decodes; where it fails on a model with top-k routers, again
    with the exact copy's decodes at its routing ties flipped (`alternatives`), which run only then."""
    failed = hf_models.within_bound(got, exact, plain, eager)
    if failed:
        tied = alternatives(decode, exact_model, plain_model)
        failed = hf_models.within_bound(got, exact, plain, eager, tied) if tied else failed
    return failed
