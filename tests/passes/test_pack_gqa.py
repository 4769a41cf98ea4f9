"""pack_gqa: decode attention on the key/value heads gives eager's logits, reads the cache without repeating it,
and leaves alone what it must: prefill, causal calls, a cache written between the repeat and the attention, and
batches of too few (batch, KV head) groups."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hf_models import compiled_graphs, decoder, static_decode

import fxquant
from fxquant.passes.annotations import fake_value
from fxquant.passes.pack_gqa import MIN_KV_GROUPS
from fxquant.passes.spellings import SDPA


def attention_calls(gm):
    return [node for node in gm.graph.nodes if node.op == "call_function" and node.target in SDPA]


def reads_a_repeat(node) -> bool:
    """Whether the attention's key or value comes from an expand (repeat_kv), not the cache itself."""
    return any(arg.op == "call_method" and arg.args[0].op == "call_method" and arg.args[0].target == "expand"
               for arg in node.args[1:3])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3", "mixtral"])
def test_decode_attention_reads_the_cache_without_repeating_it(arch):
    model = decoder(arch)
    batch = MIN_KV_GROUPS // model.config.num_key_value_heads
    prompt, steps = torch.randint(0, 512, (batch, 5)), torch.randint(0, 512, (batch, 4))
    eager = static_decode(model, model, prompt, steps)
    forward, graphs = compiled_graphs(model)
    got = static_decode(model, forward, prompt, steps)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-2)  # bf16 logits; a wrong head grouping moves them by ~1
    prefill, decode = graphs
    prefill_attention = attention_calls(prefill)
    assert len(prefill_attention) == model.config.num_hidden_layers and all(
        fake_value(n.args[0]).shape == (batch, model.config.num_attention_heads, 5, 64)
        for n in prefill_attention)  # five query positions: left as traced
    packed = attention_calls(decode)
    assert len(packed) == model.config.num_hidden_layers and not any(reads_a_repeat(n) for n in packed)
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert all(n.args[0].args[1:] == (batch, kv_heads, heads // kv_heads, 64) for n in packed)  # query rows per KV head


class Attention(nn.Module):
    """One attention call over a [B, Hkv, L, D] cache repeated transformers' way, with an optional write to the
    cache between the repeat and the attention."""

    def __init__(self, write_between=False, is_causal=False):
        super().__init__()
        self.write_between, self.is_causal = write_between, is_causal

    def forward(self, q, cache, mask, new):
        b, kv_heads, length, d = cache.shape
        n = q.shape[1] // kv_heads
        k = cache[:, :, None, :, :].expand(b, kv_heads, n, length, d).reshape(b, kv_heads * n, length, d)
        v = cache.unsqueeze(2).expand(b, kv_heads, n, length, d).reshape(b, kv_heads * n, length, d)
        if self.write_between:
            cache.index_copy_(2, torch.tensor([0]), new)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.is_causal)


def run(module, q, mask):
    """(eager output, compiled output, the compiled graph, the cache after each run), over a cache of 2 KV heads."""
    torch.manual_seed(0)
    cache, new = torch.randn(q.shape[0], 2, 16, 64), torch.randn(q.shape[0], 2, 1, 64)
    want_cache = cache.clone()
    want = module(q, want_cache, mask, new)
    forward, graphs = compiled_graphs(module, fullgraph=True)
    got = forward(q, cache, mask, new)
    return want, got, graphs[0], want_cache, cache


@pytest.mark.parametrize("mask", ["none", "shared bool", "per-head float"])
def test_every_mask_shape_gives_eager_attention(mask):
    batch = MIN_KV_GROUPS // 2
    q = torch.randn(batch, 8, 1, 64)
    masks = {"none": None, "shared bool": torch.rand(batch, 1, 1, 16) > 0.3,
             "per-head float": torch.randn(batch, 8, 1, 16)}
    want, got, gm, _, _ = run(Attention(), q, masks[mask])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    attention = attention_calls(gm)
    assert len(attention) == 1 and not reads_a_repeat(attention[0])


@pytest.mark.parametrize("case", ["prefill", "causal", "write between", "few groups"])
def test_what_is_not_one_query_over_an_unwritten_cache_of_enough_groups_keeps_its_repeat(case):
    batch = MIN_KV_GROUPS // 2 - (case == "few groups")
    q = torch.randn(batch, 8, 3 if case == "prefill" else 1, 64)
    module = Attention(write_between=case == "write between", is_causal=case == "causal")
    want, got, gm, want_cache, cache = run(module, q, None)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # with the write: the repeat's copy, pre-write
    torch.testing.assert_close(cache, want_cache, rtol=0, atol=0)  # and the write itself kept
    attention = attention_calls(gm)
    assert len(attention) == 1 and reads_a_repeat(attention[0])


def test_every_node_the_rewrite_adds_carries_its_fake_value():
    batch = MIN_KV_GROUPS // 2
    _, _, gm, _, _ = run(Attention(), torch.randn(batch, 8, 1, 64), torch.randn(batch, 8, 1, 16))
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method"):
            assert isinstance(fake_value(node), torch.Tensor), node.format_node()
    packed = attention_calls(gm)[0]
    assert fake_value(packed).shape == (batch, 2, 4, 64)
    assert fake_value(packed.kwargs["attn_mask"]).shape == (batch, 2, 4, 16)


def test_an_exported_decode_step_reads_the_cache_without_repeating_it():
    batch = MIN_KV_GROUPS // 2
    torch.manual_seed(0)
    args = (torch.randn(batch, 8, 1, 64), torch.randn(batch, 2, 16, 64), torch.rand(batch, 1, 1, 16) > 0.3,
            torch.randn(batch, 2, 1, 64))
    program = fxquant.export(Attention(), args, config={"skip": [".*"]})
    attention = attention_calls(program.graph_module)
    assert len(attention) == 1 and all(arg.op == "placeholder" for arg in attention[0].args[1:3])
    torch.testing.assert_close(program.module()(*args), Attention()(*args), rtol=1e-5, atol=1e-5)


def test_a_left_padded_batch_generates_as_eager_with_its_decode_attention_packed():
    """Batched generate() as users run it: prompts of different lengths, left-padded, with their attention mask, on
    a static cache. Packed on the KV heads, each sequence's decode attention must still skip its own padding. fp32,
    so that a rounding cannot flip a greedy token."""
    model = decoder("llama", dtype=torch.float32)
    batch, width = MIN_KV_GROUPS // model.config.num_key_value_heads, 8
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, width + 1, (batch,), generator=generator)
    mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    ids = torch.randint(1, 512, (batch, width), generator=generator).masked_fill(~mask, 0)
    kwargs = dict(attention_mask=mask.long(), max_new_tokens=5, do_sample=False, pad_token_id=0,
                  cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        model.forward, graphs = compiled_graphs(model.forward)
        got = model.generate(ids, **kwargs)
    assert lengths.unique().numel() > 1  # the padding differs between sequences
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-4, atol=1e-4)
    decode = graphs[-1]
    packed = attention_calls(decode)
    assert len(packed) == model.config.num_hidden_layers and not any(reads_a_repeat(n) for n in packed)
