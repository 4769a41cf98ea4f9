"""route_ties: the decode bound's other choice at an MoE routing tie, found and flipped in the exact copy alone."""

import pytest
import route_ties
import torch
from hf_models import VOCAB, angle, decoder, fake_quantized, static_decode, traced, within_bound
from route_ties import TIE_FACTOR, TOPK_ROUTERS, alternatives, flipped, routers_hooked, ties

GENERATOR = torch.Generator().manual_seed(4)
PROMPT = torch.randint(0, VOCAB, (2, 6), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 3), generator=GENERATOR)


def decode(model):
    return static_decode(model, model, PROMPT, STEPS)


def copies(model, recipe="int4_wo"):
    return fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)


def test_a_flip_swaps_one_token_s_last_chosen_expert_for_the_first_left_out_and_reweights_it():
    router = next(m for m in decoder("mixtral").modules() if isinstance(m, TOPK_ROUTERS))
    logits = torch.tensor([[4.0, 3.0, 2.9, 0.0], [1.0, 2.0, 3.0, 4.0]])
    probs = torch.softmax(logits, dim=-1)
    values, indices = probs.topk(2, dim=-1)
    scores = values / values.sum(-1, keepdim=True)
    got_scores, got_indices = flipped(router, logits, scores, indices, token=0)
    assert got_indices[0].tolist() == [0, 2] and torch.equal(got_indices[1], indices[1])
    assert torch.allclose(got_scores[0], probs[0, [0, 2]] / probs[0, [0, 2]].sum())
    assert torch.equal(got_scores[1], scores[1])  # the other tokens as the router gave them


def test_a_router_deciding_by_nothing_ties_everywhere_and_the_bound_takes_either_choice():
    """Routers of zero weight give every expert the same logit: every token of every router call is a tie. A decode
    that took the other expert once lies far outside the exact copy's bound, and within it given the flipped
    decodes; an unquantized model stays outside."""
    model = decoder("mixtral")
    for router in (m for m in model.modules() if isinstance(m, TOPK_ROUTERS)):
        router.weight.data.zero_()
    exact_model, plain_model = copies(model)
    with routers_hooked(exact_model) as calls:
        exact = decode(exact_model)
    assert len(ties(calls, calls, top_k=2)) == sum(c.shape[0] for c in calls)  # every token of every call
    flips = alternatives(decode, exact_model, plain_model)
    assert len(flips) == route_ties.MOST_FLIPS + 1 and all(not torch.equal(alt, exact) for alt in flips)
    plain, eager = decode(plain_model), decode(model)
    took_the_other = flips[0]
    assert within_bound(took_the_other, exact, plain, eager)  # outside the bound of the exact copy alone
    assert not within_bound(took_the_other, exact, plain, eager, flips)
    assert not route_ties.within_bound(took_the_other, exact, plain, eager, decode, exact_model, plain_model)
    assert route_ties.within_bound(eager, exact, plain, eager, decode, exact_model, plain_model)


def test_ties_are_the_few_tokens_within_rounding_and_a_dense_model_has_none():
    """In the test Mixtral most routing decisions are far from a tie; each tie found is within TIE_FACTOR of its
    call's rounding spread; a dense Llama has no router."""
    exact_model, plain_model = copies(decoder("mixtral"))
    with routers_hooked(exact_model) as exact_calls:
        decode(exact_model)
    with routers_hooked(plain_model) as plain_calls:
        decode(plain_model)
    found = ties(exact_calls, plain_calls, top_k=2)
    decisions = sum(c.shape[0] for c in exact_calls)
    assert len(found) < decisions // 4, (len(found), decisions)
    for margin, call, _ in found:
        assert margin <= TIE_FACTOR * float((exact_calls[call] - plain_calls[call]).abs().max())
    assert alternatives(decode, *copies(decoder("llama"))) == []


@pytest.mark.slow  # a minute of CPU: six decodes through dynamo, each traced anew, a graph break at every router
def test_a_tie_flips_in_a_traced_decode_as_in_an_eager_one(monkeypatch):
    """Copies run through dynamo (hf_models.traced, as tests/test_moe.py bounds compiled models): the hooks run
    eagerly at a graph break, so each flip takes effect where the eager decode's does (the two paths' logits may
    differ by their own rounding, so each traced flip lies nearer its eager twin than the unflipped decode)."""
    monkeypatch.setattr(route_ties, "MOST_FLIPS", 2)
    model = decoder("mixtral")
    for router in (m for m in model.modules() if isinstance(m, TOPK_ROUTERS)):
        router.weight.data.zero_()
    exact_model, plain_model = copies(model)
    through_dynamo = lambda m: static_decode(m, traced(m), PROMPT, STEPS)
    eager_flips, traced_flips = (alternatives(run, exact_model, plain_model) for run in (decode, through_dynamo))
    exact, traced_exact = decode(exact_model), through_dynamo(exact_model)
    assert len(traced_flips) == len(eager_flips) == 3
    for eager_flip, traced_flip in zip(eager_flips, traced_flips, strict=True):
        moved = [s for s in range(len(exact)) if angle(eager_flip[s], exact[s]) > 1e-2]
        assert moved and all(angle(traced_flip[s], eager_flip[s]) < angle(traced_flip[s], traced_exact[s])
                             for s in moved)
