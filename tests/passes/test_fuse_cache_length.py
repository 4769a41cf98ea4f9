"""fuse_cache_length: a layer's cache length, read for its write positions and then grown, is counted in its rotary +
cache write op. A decode with the pass gives the bits of the same decode without it (the op's reference runs on the
CPU), and a graph that reads or grows the length anywhere else keeps its own arithmetic."""

import functools

import pytest
import torch
import transformers as T
from hf_models import compiled_results, decoder, static_decode

import fxquant
from fxquant import FP8StaticCache
from fxquant.compile import pipeline
from fxquant.numerics import reference_rotary
from fxquant.passes.decode_attention import DecodeAttention
from fxquant.passes.fuse_cache_length import FuseCacheLength
from fxquant.passes.fuse_rotary_cache import FuseRotaryCache

WRITE = torch.ops.fxquant.rotary_cache_write.default
APPEND = torch.ops.fxquant.rotary_cache_append.default
APPEND_E4M3 = torch.ops.fxquant.rotary_cache_append_e4m3.default


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(pipeline, "FuseRotaryCache", functools.partial(FuseRotaryCache, devices=("cpu",)))


@pytest.fixture
def decode_passes_on_the_cpu(on_the_cpu, monkeypatch):
    """The rotary write and decode attention rewritten on the CPU too, as they rewrite a GPU's decode step."""
    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))


def count(gm, *targets):
    return sum(node.target in targets for node in gm.graph.nodes)


def growths(gm):
    """The in-place adds to a cache length (a 0-d tensor)."""
    return sum(node.op == "call_method" and node.target == "add_" and node.args[0].meta["example_value"].dim() == 0
               for node in gm.graph.nodes)


def decode(model, cache_class, **options):
    """Logits of a prefill and three teacher-forced steps, the cache's tensors after them and its layers' lengths,
    and the decode step's graph."""
    forward, graphs = compiled_results(model, options={"inner": "eager", "skip": [".*"], **options},
                                       keep=lambda result: result.gm)
    generator = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 512, (2, 5), generator=generator)
    steps = torch.randint(0, 512, (2, 3), generator=generator)
    cache = cache_class(config=model.config, max_cache_len=16)
    logits = []
    with torch.no_grad():
        for ids, start in [(prompt, 0)] + [(steps[:, i:i + 1], 5 + i) for i in range(steps.shape[1])]:
            out = forward(input_ids=ids, past_key_values=cache, use_cache=True,
                          cache_position=torch.arange(start, start + ids.shape[1]))
            logits.append(out.logits[:, -1].float())
    state = [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return torch.stack(logits), state, [int(layer.cumulative_length) for layer in cache.layers], graphs[-1]


@pytest.mark.parametrize(("arch", "overrides", "cache_class", "op"), [
    ("llama", {}, T.StaticCache, APPEND),
    ("qwen3", dict(num_hidden_layers=3), T.StaticCache, APPEND),
    ("llama", {}, FP8StaticCache, APPEND_E4M3),  # codes and scales at the same length
    ("gpt_oss", dict(attn_implementation="eager"), T.StaticCache, APPEND),
], ids=["llama", "qwen3", "llama_e4m3_cache", "gpt_oss"])
def test_every_layer_but_the_first_counts_its_length_in_its_op_with_the_same_bits(arch, overrides, cache_class, op,
                                                                                   on_the_cpu):
    model = decoder(arch, **overrides)
    got, state, lengths, graph = decode(model, cache_class)
    want, want_state, _, unfused = decode(model, cache_class, disable_passes=["fuse_cache_length"])
    layers = model.config.num_hidden_layers
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert len(state) == len(want_state) and all(torch.equal(a, b) for a, b in zip(state, want_state, strict=True))
    assert lengths == [8] * layers
    # the first layer's length positions the step's rotary embedding and mask too: it keeps its own add
    assert count(graph, op) == layers - 1 and growths(graph) == 1
    assert count(unfused, op) == 0 and growths(unfused) == layers


def _step(q, k, v, cos, sin, length, k_cache, v_cache, variant):
    """A layer's decode write as transformers' StaticCache spells it (a sliding layer not yet full grows its length
    after the write), and the variants the pass must leave."""
    seen = length + 0 if variant == "length_read_before" else None
    positions = torch.arange(q.shape[2]) + length
    grown_after = variant in ("grown_after", "length_read_after_write")
    if not grown_after:
        length.add_(2 if variant == "grown_by_two" else q.shape[2])
    if variant == "length_read_between":
        seen = length * 1
    out = WRITE(q, k, v, cos, sin, positions, k_cache, v_cache)
    if variant == "length_read_after_write":
        seen = length * 1
    if grown_after:
        length.add_(q.shape[2])
    return out, positions if variant == "positions_read" else seen


def _operands():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 1, 64, generator=gen).bfloat16() for h in (4, 2, 2))
    angles = torch.rand(1, 1, 1, 64, generator=gen) * 6
    caches = [torch.randn(1, 2, 8, 64, generator=gen).bfloat16() for _ in range(2)]
    return [q, k, v, angles.cos(), angles.sin(), torch.tensor(3), *caches]


def _compiled(variant):
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, FuseCacheLength()(gm).modified))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(functools.partial(_step, variant=variant), backend=backend, fullgraph=True), seen


@pytest.mark.parametrize("variant", ["plain", "grown_after"])
def test_the_fused_step_appends_at_the_length_and_grows_it(variant):
    step, seen = _compiled(variant)
    got_inputs, want_inputs = _operands(), _operands()
    got, _ = step(*got_inputs)
    (gm, modified), = seen
    assert modified and count(gm, APPEND) == 1 and count(gm, WRITE) == 0 and growths(gm) == 0
    want = reference_rotary.rotary_cache_append(*want_inputs)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_inputs[5:], want_inputs[5:], strict=True))
    assert int(got_inputs[5]) == 4 and not torch.equal(got_inputs[6][:, :, 3], _operands()[6][:, :, 3])


@pytest.mark.parametrize("variant", ["length_read_before", "length_read_between", "length_read_after_write",
                                     "grown_by_two", "positions_read"])
def test_a_length_read_or_grown_elsewhere_keeps_its_own_arithmetic(variant):
    step, seen = _compiled(variant)
    got_inputs, want_inputs = _operands(), _operands()
    got = step(*got_inputs)
    (gm, modified), = seen
    assert not modified and count(gm, WRITE) == 1 and growths(gm) == 1
    want = _step(*want_inputs, variant=variant)
    assert torch.equal(got[0], want[0]) and (got[1] is want[1] is None or torch.equal(got[1], want[1]))
    assert all(torch.equal(a, b) for a, b in zip(got_inputs[5:], want_inputs[5:], strict=True))


def test_fxquant_generate_gives_the_same_tokens_with_the_length_counted_in_the_op(decode_passes_on_the_cpu):
    """fxquant.generate, as a user runs it: a left-padded batch whose second sequence ends early, greedy, decoded
    through the rotary op that grows each layer's length (and decode attention over the cache), gives the tokens of
    the same decode with the lengths grown by Inductor's adds, and a second call on the same model too."""
    model = decoder("llama")
    ids = torch.randint(1, 512, (3, 8), generator=torch.Generator().manual_seed(9))
    mask = (torch.arange(8)[None, :] >= 3 * torch.arange(3)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0)
    settings = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    options = {"inner": "eager", "skip": [".*"]}
    want = fxquant.generate(model, ids, options={**options, "disable_passes": ["fuse_cache_length"]}, **settings)
    eos = int(want[1, 8 + 2])  # the second sequence ends mid-way
    want_eos = fxquant.generate(model, ids, options={**options, "disable_passes": ["fuse_cache_length"]},
                                eos_token_id=eos, **settings)
    torch._dynamo.reset()
    assert torch.equal(fxquant.generate(model, ids, options=options, **settings), want)
    assert torch.equal(fxquant.generate(model, ids, options=options, eos_token_id=eos, **settings), want_eos)


def test_the_report_names_the_layers_whose_length_the_op_counts(on_the_cpu, capsys):
    model = decoder("llama", num_hidden_layers=3)
    forward, _ = compiled_results(model, options={"inner": "eager", "skip": [".*"], "report": True})
    static_decode(model, forward, torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 2)))
    layers = ", ".join(f"model.layers.{i}.self_attn" for i in (1, 2))  # the first layer's length keeps its add
    assert f"the cache's length counted in that kernel: {layers}" in capsys.readouterr().out
