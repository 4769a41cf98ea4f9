"""decode_attention: a decode step's attention becomes fxquant's split-KV op over the cache as stored, with eager's
logits to bf16's rounding, its cache writes kept; prefill and calls it does not serve keep SDPA. On the CPU the op
runs its fp32 reference, so the pass is enabled for the CPU here (it rewrites CUDA graphs only by default)."""

import copy
import functools

import pytest
import torch
from hf_models import angle, compiled_graphs, decoder, static_decode  # compiled_graphs: nothing quantized

from fxquant import pipeline
from fxquant.passes.decode_attention import MAX_QUERIES, DecodeAttention
from fxquant.passes.side_effects import has_side_effects
from fxquant.passes.spellings import SDPA

ATTENTION = torch.ops.fxquant.decode_attention.default


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))


def count(gm, targets):
    return sum(node.op == "call_function" and node.target in targets for node in gm.graph.nodes)


def writes(gm):
    return sum(node.op.startswith("call") and has_side_effects(node) for node in gm.graph.nodes)


@pytest.mark.parametrize("padded", [False, True], ids=["", "left_padded"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_decode_steps_attend_over_the_cache_as_stored(arch, padded, on_the_cpu):
    model = decoder(arch)
    generator = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 512, (2, 5), generator=generator)
    steps = torch.randint(0, 512, (2, 3), generator=generator)
    padding = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]) if padded else None
    eager = static_decode(model, model, prompt, steps, padding=padding)
    wide = copy.deepcopy(model).float()
    exact = static_decode(wide, wide, prompt, steps, padding=padding)
    forward, graphs = compiled_graphs(model)
    got = static_decode(model, forward, prompt, steps, padding=padding)
    for step in range(len(got)):
        # Both are bf16 computations of the fp32 model, each about bf16's own distance from it (the op's attention
        # rounds once from fp32, SDPA's otherwise): apart by at most twice that. A wrong head grouping or a mask
        # ignored moves the logits by 0.1 rad and more.
        assert angle(got[step], eager[step]) <= 2 * angle(eager[step], exact[step]), step
    layers = model.config.num_hidden_layers
    prefill, decode = graphs[0], graphs[-1]
    assert count(prefill, SDPA) == layers and count(prefill, {ATTENTION}) == 0  # 5 positions: prefill keeps SDPA
    assert count(decode, {ATTENTION}) == layers and count(decode, SDPA) == 0
    assert writes(decode) >= 2 * layers  # every cache write kept


def test_a_second_run_changes_nothing_and_prefill_is_left_alone(on_the_cpu):
    model = decoder("llama")
    forward, graphs = compiled_graphs(model)
    static_decode(model, forward, torch.randint(0, 512, (1, MAX_QUERIES + 1)), torch.randint(0, 512, (1, 1)))
    prefill, decode = graphs[0], graphs[-1]
    assert not DecodeAttention(devices=("cpu",))(decode).modified
    assert not DecodeAttention(devices=("cpu",))(prefill).modified


def test_cuda_graphs_alone_are_rewritten_by_default():
    model = decoder("llama")
    forward, graphs = compiled_graphs(model)
    static_decode(model, forward, torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 1)))
    assert count(graphs[-1], {ATTENTION}) == 0 and count(graphs[-1], SDPA) == model.config.num_hidden_layers
