"""decode_attention: a decode step's attention becomes fxquant's split-KV op over the cache as stored, with eager's
logits to bf16's rounding, its cache writes kept; prefill and calls it does not serve keep SDPA. On the CPU the op
runs its fp32 reference, so the pass is enabled for the CPU here (it rewrites CUDA graphs only by default)."""

import copy
import functools

import pytest
import torch
from hf_models import NOTHING, angle, compiled_graphs, decoder, static_decode  # compiled_graphs: nothing quantized

from fxquant.compile import pipeline
from fxquant.passes.decode_attention import MAX_QUERIES, DecodeAttention
from fxquant.passes.side_effects import has_side_effects
from fxquant.passes.spellings import MATMUL, SDPA

ATTENTION = torch.ops.fxquant.decode_attention.default


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))


def count(gm, targets):
    return sum(node.op == "call_function" and node.target in targets for node in gm.graph.nodes)


def writes(gm):
    return sum(node.op.startswith("call") and has_side_effects(node) for node in gm.graph.nodes)


# (architecture, its overrides): SDPA over repeated KV heads, over one KV head per query head (no repeat), and
# transformers' eager spelling, Gemma2's with logit soft-capping
CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mixtral": ("mixtral", {}),
    "mistral_sliding_window": ("mistral", dict(sliding_window=4)),  # rolls: 5 prompt tokens and 3 steps over 4
    "llama_one_query_head_per_kv_head": ("llama", dict(num_key_value_heads=4)),
    "llama_eager": ("llama", dict(attn_implementation="eager")),
    "gemma2_eager_soft_capped": ("gemma2", dict(attn_implementation="eager")),
    "gpt_oss_eager_sinks": ("gpt_oss", dict(attn_implementation="eager")),
}


@pytest.mark.parametrize("padded", [pytest.param(False, marks=pytest.mark.slow), True],  # CI: the padded case
                         ids=["", "left_padded"])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_steps_attend_over_the_cache_as_stored(case, padded, on_the_cpu):
    arch, overrides = CASES[case]
    model = decoder(arch, **overrides)
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
        # rounds once from fp32, SDPA's otherwise): apart by at most twice that. A wrong head grouping, a mask
        # ignored or a soft cap dropped moves the logits by 0.1 rad and more.
        assert angle(got[step], eager[step]) <= 2 * angle(eager[step], exact[step]), step
    layers = model.config.num_hidden_layers
    prefill, decode = graphs[0], graphs[-1]
    assert count(prefill, {ATTENTION}) == 0  # 5 positions: prefill keeps its attention
    assert count(decode, {ATTENTION}) == layers and count(decode, SDPA) == 0
    # the eager spelling's two matmuls per layer go; others (the rotary embedding's) stay
    assert count(decode, MATMUL) == count(prefill, MATMUL) - (2 * layers if "eager" in case else 0)
    attends = [node for node in decode.graph.nodes if node.target is ATTENTION]
    if "soft_capped" in case:
        assert all(node.args[5] == model.config.attn_logit_softcapping for node in attends)
    assert all((node.args[6] is not None) == ("sinks" in case) for node in attends)
    assert writes(decode) >= 2 * layers  # every cache write kept


def test_the_op_applies_gemma2s_soft_cap(on_the_cpu):
    """With logits past the cap (q and k projections scaled up), the compiled decode stays within the bound of
    eager, and the same model without its cap falls outside it: the bound sees a cap dropped."""
    model = decoder("gemma2", attn_implementation="eager", attn_logit_softcapping=2.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 30
            layer.self_attn.k_proj.weight *= 30
    prompt, steps = torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 3))
    eager = static_decode(model, model, prompt, steps)
    wide = copy.deepcopy(model).float()
    exact = static_decode(wide, wide, prompt, steps)
    uncapped = copy.deepcopy(model)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    dropped = static_decode(uncapped, uncapped, prompt, steps)
    forward, graphs = compiled_graphs(model)
    got = static_decode(model, forward, prompt, steps)
    assert count(graphs[-1], {ATTENTION}) == model.config.num_hidden_layers
    for step in range(len(got)):
        bound = 2 * angle(eager[step], exact[step])
        assert angle(got[step], eager[step]) <= bound < angle(dropped[step], eager[step]), step


def test_a_second_run_changes_nothing_and_prefill_is_left_alone(on_the_cpu):
    model = decoder("llama")
    forward, graphs = compiled_graphs(model)
    static_decode(model, forward, torch.randint(0, 512, (1, MAX_QUERIES + 1)), torch.randint(0, 512, (1, 1)))
    prefill, decode = graphs[0], graphs[-1]
    assert not DecodeAttention(devices=("cpu",))(decode).modified
    assert not DecodeAttention(devices=("cpu",))(prefill).modified


def test_the_report_names_the_attention_on_the_kernel_and_why_the_rest_stays(on_the_cpu, capsys):
    """Decode attention the kernel serves is listed; one it does not (a head dim it does not tile) keeps SDPA, and
    the report says why, by layer. Prefill's attention, which is not decode, is not mentioned."""
    for head_dim, served in ((64, True), (32, False)):
        model = decoder("llama", head_dim=head_dim)
        torch._dynamo.reset()
        forward = torch.compile(model, backend="fxquant", options={**NOTHING, "report": True})
        static_decode(model, forward, torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 2)))
        report = capsys.readouterr().out
        layers = [f"model.layers.{i}.self_attn" for i in range(model.config.num_hidden_layers)]
        listed = f"decode attention on fxquant's split-KV kernel: {', '.join(layers)}"
        left = [f"info: {layer}: decode attention stays on SDPA: head dim 32; the kernel tiles 64, 128, 256"
                for layer in layers]
        assert (listed in report.splitlines()) == served, report
        assert all((line in report.splitlines()) != served for line in left), report


def test_cuda_graphs_alone_are_rewritten_by_default():
    model = decoder("llama")
    forward, graphs = compiled_graphs(model)
    static_decode(model, forward, torch.randint(0, 512, (1, 5)), torch.randint(0, 512, (1, 1)))
    assert count(graphs[-1], {ATTENTION}) == 0 and count(graphs[-1], SDPA) == model.config.num_hidden_layers
