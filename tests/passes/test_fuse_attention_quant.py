"""fuse_attention_quant: decode attention feeding only the o-projection's fp8 quantizer becomes one op whose kernel
quantizes as it merges. On the CPU the ops run their references, which give the unfused graph's bits, so a decode
step fused must equal the same step with the pass left out, bit for bit; decode_attention and fuse_rotary_cache are
enabled for the CPU here (they rewrite CUDA graphs only by default)."""

import functools

import pytest
import torch
import transformers as T
from hf_models import compiled_results, decoder, static_decode
from torch.fx.experimental.proxy_tensor import make_fx

from fxquant import FP8StaticCache
from fxquant.compile import pipeline
from fxquant.numerics import reference as R
from fxquant.passes.decode_attention import DecodeAttention
from fxquant.passes.fuse_attention_quant import FuseAttentionQuant
from fxquant.passes.fuse_rotary_cache import FuseRotaryCache

FUSED = torch.ops.fxquant.decode_attention_quantize_fp8.default
ATTENTION = torch.ops.fxquant.decode_attention.default


@pytest.fixture
def on_the_cpu(monkeypatch):
    """decode_attention and fuse_rotary_cache as they rewrite a GPU's graph: attention's query is the rotary op's."""
    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))
    monkeypatch.setattr(pipeline, "FuseRotaryCache", functools.partial(FuseRotaryCache, devices=("cpu",)))


def count(gm, target):
    return sum(node.target == target for node in gm.graph.nodes)


def decode(model, recipe, cache_class=T.StaticCache, **options):
    """Logits of a prefill and three steps over `cache_class`, and the decode step's graph, compiled with `recipe`."""
    forward, graphs = compiled_results(model, options={"recipe": recipe, "inner": "eager", **options},
                                       keep=lambda result: result.gm)
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 512, (2, 5), generator=generator)
    steps = torch.randint(0, 512, (2, 3), generator=generator)
    return static_decode(model, forward, prompt, steps, cache_class=cache_class), graphs[-1]


@pytest.mark.parametrize(("arch", "overrides", "recipe", "fused"), [
    ("llama", {}, "fp8_row", True),
    ("llama", {"cache": FP8StaticCache}, "fp8_row", True),  # attention over e4m3 codes
    ("qwen2", {}, "fp8_row", True),
    ("mixtral", {}, "fp8_row", True),
    ("gemma2", dict(attn_implementation="eager"), "fp8_row", True),  # soft-capped logits
    ("gpt_oss", dict(attn_implementation="eager"), "fp8_row", True),  # sinks, and an o-projection with a bias
    ("llama", {}, "int4_fp8", True),  # the W4A8 GEMM reads the quantizer's codes as they are
    ("llama", {}, "fp8_block", False),  # groups of 128 across 64-wide heads: the kernel would not fuse them
], ids=["llama", "llama_e4m3_cache", "qwen2", "mixtral", "gemma2_softcap", "gpt_oss_sinks_bias", "llama_int4_fp8",
        "llama_fp8_block"])
def test_the_decode_step_quantizes_attention_in_its_op_with_the_unfused_bits(arch, overrides, recipe, fused,
                                                                               on_the_cpu):
    overrides = dict(overrides)
    cache_class = overrides.pop("cache", T.StaticCache)
    model = decoder(arch, **overrides)
    got, graph = decode(model, recipe, cache_class)
    want, unfused = decode(model, recipe, cache_class, disable_passes=("fuse_attention_quant",))
    layers = model.config.num_hidden_layers
    assert count(unfused, ATTENTION) == layers and count(unfused, FUSED) == 0
    assert count(graph, FUSED) == (layers if fused else 0)
    assert count(graph, ATTENTION) == (0 if fused else layers)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def _attention_into_linear(layout):
    """make_fx's graph of decode attention over 3 query positions whose output reaches an fp8 linear through
    `layout`, with the linear's weight."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 64, generator=gen).bfloat16()
    k, v = (torch.randn(2, 2, 16, 64, generator=gen).bfloat16() for _ in range(2))
    weight = R.quantize(torch.randn(128, 256, generator=gen) * 0.05, "fp8_e4m3", "channel")

    def step(q, k, v, w, w_scale):
        o = torch.ops.fxquant.decode_attention(q, k, v, None, 0.125, 0.0, None, None, None, None)
        return torch.ops.fxquant.linear_fp8(layout(o), w, w_scale, None, 0)

    args = (q, k, v, weight.data, weight.scale)
    return make_fx(step, tracing_mode="fake")(*args), args


@pytest.mark.parametrize(("layout", "fused"), [
    (lambda o: o.transpose(1, 2).reshape(2, 3, 256), True),  # transformers' o-projection input
    (lambda o: o.transpose(1, 2).contiguous().view(2, 3, -1), True),
    (lambda o: o.reshape(2, 3, 256), False),  # positions and heads interleaved: not a token's heads
    (lambda o: o.transpose(1, 2).reshape(2, 3, 256) * 2, False),  # not a layout op
    (lambda o: o.transpose(1, 2).reshape(2, 3, 256) + o.sum(), False),  # the output read twice
], ids=["transpose_reshape", "contiguous_view", "untransposed", "scaled", "read_twice"])
def test_only_the_o_projection_s_layout_of_an_output_read_once_is_fused(layout, fused):
    gm, args = _attention_into_linear(layout)
    want = gm(*args)
    assert FuseAttentionQuant()(gm).modified == fused
    assert count(gm, FUSED) == int(fused) and count(gm, ATTENTION) == int(not fused)
    assert torch.equal(gm(*args), want)
