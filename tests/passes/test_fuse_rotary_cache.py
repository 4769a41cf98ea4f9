"""fuse_rotary_cache: a decode step's rotary embedding and KV cache write become one op, with every write kept and
ordered against every read. On the CPU the op runs its reference, so the pass is enabled for the CPU here (it
rewrites CUDA graphs only by default)."""

import copy
import functools

import pytest
import torch
import transformers as T
from hf_models import angle, compiled_graphs, decoder, static_decode

from fxquant import FP8StaticCache
from fxquant.compile import pipeline
from fxquant.numerics import reference_rotary
from fxquant.passes.fuse_rotary_cache import FuseRotaryCache, rotary
from fxquant.passes.side_effects import has_side_effects

OP = torch.ops.fxquant.rotary_cache_write.default
OP_E4M3 = torch.ops.fxquant.rotary_cache_write_e4m3.default
# fuse_cache_length then counts the cache's length in the op: the same rotation and writes, at the length
APPENDED = {OP: torch.ops.fxquant.rotary_cache_append.default,
            OP_E4M3: torch.ops.fxquant.rotary_cache_append_e4m3.default}


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(pipeline, "FuseRotaryCache", functools.partial(FuseRotaryCache, devices=("cpu",)))


def count(gm, target):
    """Nodes of `target`, or of its appending form."""
    return sum(node.target in (target, APPENDED.get(target)) for node in gm.graph.nodes)


def cache_writes(gm):
    return sum(node.op == "call_method" and node.target == "index_copy_" for node in gm.graph.nodes)


@pytest.mark.parametrize(("arch", "overrides", "cache", "fused"), [
    ("llama", {}, T.StaticCache, OP),
    ("qwen2", {}, T.StaticCache, OP),
    ("llama", dict(attn_implementation="eager"), T.StaticCache, OP),
    ("llama", {}, FP8StaticCache, OP_E4M3),
    ("mistral", dict(sliding_window=4), T.StaticCache, None),  # a sliding layer rolls its cache: no index_copy_
    ("qwen3", {}, T.StaticCache, OP),  # q and k normed before their rotation
    ("gemma3", {}, T.StaticCache, OP),
    ("falcon", {}, T.StaticCache, OP),
    ("gpt_neox", {}, T.StaticCache, None),  # a quarter of each head rotated: left to Inductor
    ("gpt_oss", dict(attn_implementation="eager"), T.StaticCache, OP),  # chunked halves, half-width cos; sinks
    ("olmo2", {}, T.StaticCache, None),  # k rotated in fp32, then cast to the cache's dtype: left to Inductor
], ids=["llama", "qwen2", "llama_eager", "llama_e4m3_cache", "mistral_sliding", "qwen3", "gemma3", "falcon",
        "gpt_neox_partial", "gpt_oss_chunked", "olmo2"])
def test_decode_steps_rotate_and_write_the_cache_in_one_op(arch, overrides, cache, fused, on_the_cpu):
    model = decoder(arch, **overrides)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (2, 5), generator=generator)
    steps = torch.randint(0, 512, (2, 3), generator=generator)
    eager = static_decode(model, model, prompt, steps, cache_class=cache)
    wide = copy.deepcopy(model).float()
    exact = static_decode(wide, wide, prompt, steps, cache_class=cache)
    forward, graphs = compiled_graphs(model)
    got = static_decode(model, forward, prompt, steps, cache_class=cache)
    for step in range(len(got)):
        # Both are bf16 computations of the fp32 model; the op rounds each rotation once, eager three times. A
        # rotation by the wrong angle, a sign lost or a write to the wrong position moves the logits by far more.
        assert angle(got[step], eager[step]) <= 2 * angle(eager[step], exact[step]), step
    layers = model.config.num_hidden_layers
    prefill, decode = graphs[0], graphs[-1]
    assert count(prefill, OP) == count(prefill, OP_E4M3) == 0  # 5 positions: prefill is left as it is
    assert count(decode, OP) + count(decode, OP_E4M3) == (count(decode, fused) if fused else 0)
    if fused:
        writes = 4 if fused is OP_E4M3 else 2  # codes and scales
        assert count(decode, fused) == layers
        assert cache_writes(prefill) == writes * layers and cache_writes(decode) == 0
    ops = [node for node in decode.graph.nodes if node.target in (OP, OP_E4M3, *APPENDED.values())]
    assert all(has_side_effects(node) for node in ops)  # the writes cleanup must keep
    # cos and sin before the model rounds them to bf16, as Inductor's unfused code reads them
    assert all(node.args[3].meta["example_value"].dtype == torch.float32 for node in ops)


def _one_step_after_prefill(model, prompt, options, run=lambda step, **inputs: step(**inputs)):
    """An eager prefill of `prompt` [1, 5] into a StaticCache, then one step at position 5 compiled with `options`
    (nothing quantized), run through `run`: (the cache, what run returned)."""
    cache = T.StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        step = torch.compile(model, backend="fxquant", options={"skip": [".*"], **options})
        return cache, run(step, input_ids=torch.tensor([[7]]), past_key_values=cache,
                          cache_position=torch.tensor([5]), use_cache=True)


def test_the_cache_holds_the_ops_rows_and_the_rest_is_untouched(on_the_cpu):
    """One step after the same eager prefill: the first layer's value row is the unfused step's bits and its key row
    that rotation to one bf16 ulp (eager rounds each product first; later layers inherit the difference), every row
    the step does not write is untouched, in every layer."""
    model = decoder("llama")
    prompt = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(4))
    caches = {}
    for disable in ((), ("fuse_rotary_cache",)):
        cache, _ = _one_step_after_prefill(model, prompt, {"inner": "eager", "disable_passes": list(disable)})
        caches[disable] = [(layer.keys, layer.values) for layer in cache.layers]
    fused, unfused = caches[()], caches[("fuse_rotary_cache",)]
    for layer in range(len(fused)):
        for got, want in zip(fused[layer], unfused[layer], strict=True):
            assert torch.equal(got[:, :, :5], want[:, :, :5]) and torch.equal(got[:, :, 6:], want[:, :, 6:])
            assert got[:, :, 5].abs().max() > 0  # written
    (k, v), (k_unfused, v_unfused) = fused[0], unfused[0]
    assert torch.equal(v[:, :, 5], v_unfused[:, :, 5])
    row, unfused_row = k[:, :, 5].float(), k_unfused[:, :, 5].float()
    assert (row - unfused_row).abs().max() <= 2 ** -7 * unfused_row.abs().max()  # one bf16 ulp


def _step(q, k, v, cos, sin, positions, k_cache, v_cache, read_between=False):
    """A hand-written decode step: transformers' rotation and cache writes, optionally reading the key cache between
    the two writes."""
    turn = lambda x: torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    q_rot, k_rot = q * cos + turn(q) * sin, k * cos + turn(k) * sin
    k_cache.index_copy_(2, positions, k_rot)
    seen = k_cache.sum() if read_between else None
    v_cache.index_copy_(2, positions, v)
    return q_rot, seen


def _operands():
    gen = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen), \
        torch.randn(1, 2, 1, 64, generator=gen)
    angles = torch.rand(1, 1, 1, 64, generator=gen) * 6
    caches = torch.randn(1, 2, 8, 64, generator=gen), torch.randn(1, 2, 8, 64, generator=gen)
    return [t.bfloat16() for t in (q, k, v, angles.cos(), angles.sin())] + [torch.tensor([3]),
                                                                            *(c.bfloat16() for c in caches)]


def _fused(read_between):
    """The step compiled by a backend that runs the pass (its graph and whether it changed it recorded)."""
    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, FuseRotaryCache(devices=("cpu",))(gm).modified))
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(functools.partial(_step, read_between=read_between), backend=backend, fullgraph=True), seen


def test_a_read_of_the_cache_between_the_writes_keeps_them_apart():
    step, seen = _fused(read_between=True)
    step(*_operands())
    (gm, modified), = seen
    assert not modified and cache_writes(gm) == 2


def test_the_fused_graph_computes_the_reference():
    step, seen = _fused(read_between=False)
    got_inputs, want_inputs = _operands(), _operands()
    got, _ = step(*got_inputs)
    (gm, modified), = seen
    assert modified and count(gm, OP) == 1 and cache_writes(gm) == 0
    q, k, v, cos, sin, positions, k_cache, v_cache = want_inputs
    want = reference_rotary.rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache)
    assert torch.equal(got, want)
    assert torch.equal(got_inputs[-2], k_cache) and torch.equal(got_inputs[-1], v_cache)
    assert not torch.equal(got_inputs[-2], _operands()[-2])  # the write happened
    assert not FuseRotaryCache(devices=("cpu",))(gm).modified  # nothing left to fuse


def _keep(captured, gm, example_inputs):
    captured.append(gm)
    return gm.forward


def test_the_rotation_matcher_takes_the_whole_head_in_either_spelling():
    def partial(x, cos, sin):  # a rotation of the first half of the head only (partial rotary)
        turn = lambda y: torch.cat((-y[..., 16:], y[..., :16]), dim=-1)
        return x[..., :32] * cos[..., :32] + turn(x[..., :32]) * sin[..., :32]

    def swapped(x, cos, sin):  # the halves not negated: not a rotation
        return x * cos + torch.cat((x[..., 32:], x[..., :32]), dim=-1) * sin

    def whole(x, cos, sin):
        return sin * torch.cat((-x[..., 32:], x[..., :32]), dim=-1) + cos * x

    def chunked(x, cos, sin):  # GPT-OSS's spelling, cos and sin half as wide
        a, b = torch.chunk(x, 2, dim=-1)
        c, s = cos[..., :32], sin[..., :32]
        return torch.cat((a * c - b * s, s * a + c * b), dim=-1)

    def chunked_signs_crossed(x, cos, sin):  # the second half's terms swapped: not a rotation
        a, b = torch.chunk(x, 2, dim=-1)
        c, s = cos[..., :32], sin[..., :32]
        return torch.cat((a * c - b * s, a * c + b * s), dim=-1)

    for fn, matched in ((partial, False), (swapped, False), (whole, True), (chunked, True),
                        (chunked_signs_crossed, False)):
        captured = []
        torch._dynamo.reset()
        torch.compile(fn, backend=functools.partial(_keep, captured), fullgraph=True)(*_operands()[:1],
                                                                                   *_operands()[3:5])
        found = [found for n in captured[0].graph.nodes if (found := rotary(n)) is not None]
        assert bool(found) == matched, fn.__name__
        if matched:
            x, cos, sin = found[0]
            source = lambda n: n if n.op == "placeholder" else n.args[0]  # the chunked spelling slices its inputs
            assert (x.name, source(cos).name, source(sin).name) == ("l_x_", "l_cos_", "l_sin_"), fn.__name__


def test_the_report_names_the_layers_fused(on_the_cpu, capsys):
    model = decoder("llama")
    torch._dynamo.reset()
    forward = torch.compile(model, backend="fxquant", options={"inner": "eager", "skip": [".*"], "report": True})
    static_decode(model, forward, torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 2)))
    layers = [f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)]
    assert f"rotary embedding and cache write in one kernel: {', '.join(layers)}" in capsys.readouterr().out


@pytest.mark.cpu_only
def test_under_inductor_the_fused_step_gives_the_unfused_steps_bits_writing_the_cache_in_place(on_the_cpu):
    """Inductor (not the eager inner compiler): the op reads cos and sin unrounded, as Inductor's unfused code does, so
    the logits and caches are the same bits; and it runs on the cache inputs themselves, with no copy of the cache."""
    import re

    from torch._inductor.utils import run_and_get_code

    model = decoder("llama")
    prompt = torch.randint(0, 512, (1, 5), generator=torch.Generator().manual_seed(8))
    results = {}
    for disable in ((), ("fuse_rotary_cache",)):
        cache, (out, code) = _one_step_after_prefill(model, prompt, {"disable_passes": list(disable)},
                                                     run=run_and_get_code)
        state = [t for layer in cache.layers for t in (layer.keys, layer.values, layer.cumulative_length)]
        results[disable] = (out.logits, *state, "\n".join(code))
    (*fused, code), (*unfused, _) = results[()], results[("fuse_rotary_cache",)]
    assert all(torch.equal(a, b) for a, b in zip(fused, unfused, strict=True))
    assert [int(layer.cumulative_length) for layer in cache.layers] == [6, 6]
    # the caches (and the second layer's length, which fuse_cache_length counts in its op) are the graph's inputs,
    # written where they are: the ops' last arguments are input buffers, not copies
    assert re.search(r"fxquant\.rotary_cache_write\.default\(.*, (arg\d+_1), (arg\d+_1)\)", code), code
    assert re.search(r"fxquant\.rotary_cache_append\.default\(.*, (arg\d+_1), (arg\d+_1), (arg\d+_1)\)", code), code
