"""fxquant.FP8StaticCache: e4m3 codes with per-(token, KV head) or static per-tensor scales, bounded by an
independent copy, transformers' own bf16 StaticCache whose new K and V pass through the reference's quantize ->
dequantize before they are stored; eagerly, compiled, and under a quantized recipe."""

import copy
import functools
import json

import pytest
import torch
import transformers as T
from hf_models import (
    VOCAB,
    angle,
    compiled,
    compiled_graphs,
    decoder,
    fake_quantized,
    skeleton,
    static_decode,
    traced,
    within_bound,
)
from safetensors import safe_open

import fxquant
from fxquant import FP8StaticCache, kv_scales_of
from fxquant.compile import pipeline
from fxquant.numerics import reference as R
from fxquant.passes.decode_attention import DecodeAttention

GENERATOR = torch.Generator().manual_seed(7)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 12), generator=GENERATOR)  # 20 positions: Mistral's window of 8 rolls
DEQUANTIZE_KV = torch.ops.fxquant.dequantize_kv.default
ATTENTION = torch.ops.fxquant.decode_attention.default
SLIDING = {"mistral": dict(sliding_window=8)}


class FakeQuantizedCache(T.StaticCache):
    """transformers' StaticCache in the model's dtype, each new K and V quantized and dequantized by the reference
    (per token, or per tensor with kv_scales) before transformers stores it."""

    def __init__(self, *args, kv_scales=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_scales = kv_scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        pair = (None, None) if self.kv_scales is None else self.kv_scales[layer_idx]
        fake = lambda x, scale: R.dequantize(R.quantize(x, "fp8_e4m3", "token" if scale is None else "tensor",
                                                        scale=scale), x.dtype)
        return super().update(fake(key_states, pair[0]), fake(value_states, pair[1]), layer_idx, *args, **kwargs)


def with_scales(cache_class, kv_scales):
    return functools.partial(cache_class, kv_scales=kv_scales)


@pytest.mark.parametrize(("arch", "padded"), [(arch, False) for arch in ("llama", "qwen2", "mistral", "gemma2",
                                                                       "mixtral")] + [("llama", True)])
def test_eager_decode_equals_the_fake_quantized_cache(arch, padded):
    """The same values reach attention: bf16(code * scale), every step; Mistral's and Gemma2's sliding layers roll
    their codes and scales together."""
    model = decoder(arch, **SLIDING.get(arch, {}))
    padding = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8]) if padded else None
    got = static_decode(model, model, PROMPT, STEPS, padding=padding, cache_class=FP8StaticCache)
    fake = static_decode(model, model, PROMPT, STEPS, padding=padding, cache_class=FakeQuantizedCache)
    unquantized = static_decode(model, model, PROMPT, STEPS, padding=padding)
    torch.testing.assert_close(got, fake, rtol=0, atol=0)
    assert (unquantized - fake).abs().amax() > 0  # the bound is not met by a bf16 cache


def test_static_scales_measured_on_a_bf16_cache_equal_the_fake_quantized_cache():
    model = decoder("llama")
    kv_scales = calibrated(model)
    assert len(kv_scales) == model.config.num_hidden_layers and all(s > 0 for pair in kv_scales for s in pair)
    got = static_decode(model, model, PROMPT, STEPS, cache_class=with_scales(FP8StaticCache, kv_scales))
    fake = static_decode(model, model, PROMPT, STEPS, cache_class=with_scales(FakeQuantizedCache, kv_scales))
    torch.testing.assert_close(got, fake, rtol=0, atol=0)


def test_per_token_scales_are_nearer_the_bf16_cache_than_per_tensor_scales():
    """The measurement behind the default: on the same prompts, per-token scales keep the logits nearer the bf16
    cache's than per-tensor scales calibrated on the prompt."""
    model = decoder("llama")
    unquantized = static_decode(model, model, PROMPT, STEPS)
    per_token = static_decode(model, model, PROMPT, STEPS, cache_class=FP8StaticCache)
    per_tensor = static_decode(model, model, PROMPT, STEPS,
                               cache_class=with_scales(FP8StaticCache, calibrated(model)))
    token_error = sum(angle(per_token[i], unquantized[i]) for i in range(len(unquantized)))
    tensor_error = sum(angle(per_tensor[i], unquantized[i]) for i in range(len(unquantized)))
    assert 0 < token_error < tensor_error


def count(gm, op) -> int:
    return sum(node.op == "call_function" and node.target is op for node in gm.graph.nodes)


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_compiled_decode_reads_the_codes_and_stays_within_the_bound(arch, on_the_cpu):
    """The decode pass hands codes and scales to fxquant.decode_attention: no dequantized cache in the decode graph.
    Prefill keeps SDPA over the dequantized cache."""
    model = decoder(arch, **SLIDING.get(arch, {}))
    fake = static_decode(model, model, PROMPT, STEPS, cache_class=FakeQuantizedCache)
    wide = copy.deepcopy(model).float()
    exact = static_decode(wide, wide, PROMPT, STEPS, cache_class=FakeQuantizedCache)
    unquantized = static_decode(model, model, PROMPT, STEPS)
    forward, graphs = compiled_graphs(model)
    got = static_decode(model, forward, PROMPT, STEPS, cache_class=FP8StaticCache)
    for step in range(len(got)):
        # the op's fp32 attention over the codes and SDPA's bf16 attention over their bf16 values: each about bf16's
        # own distance from the fp32 model's, so apart by at most twice that; and nearer than the bf16 cache
        distance, bound = angle(got[step], fake[step]), 2 * angle(fake[step], exact[step])
        assert distance <= bound and distance < angle(unquantized[step], fake[step]), step
    layers = model.config.num_hidden_layers
    prefill, decode = graphs[0], graphs[-1]
    assert count(decode, ATTENTION) == layers and count(decode, DEQUANTIZE_KV) == 0
    assert count(prefill, ATTENTION) == 0 and count(prefill, DEQUANTIZE_KV) == 2 * layers


def test_a_full_layer_counts_its_positions_once_as_the_bf16_cache_does():
    """The scales go where the codes go, at one count of the positions a layer: the compiled decode step advances as
    many counters as over transformers' bf16 StaticCache, one a layer (a twin counter for the scales was a GPU kernel
    a layer). The values written are checked against the fake-quantized cache by the tests above."""
    advances = lambda gm: sum(node.op == "call_method" and node.target == "add_" for node in gm.graph.nodes)
    model = decoder("llama")
    counted = {}
    for cache_class in (T.StaticCache, FP8StaticCache):
        forward, graphs = compiled_graphs(model)
        static_decode(model, forward, PROMPT, STEPS[:, :2], cache_class=cache_class)
        counted[cache_class] = advances(graphs[-1])
    assert counted[T.StaticCache] == counted[FP8StaticCache] == model.config.num_hidden_layers, counted


@pytest.mark.slow
def test_a_16k_token_decode_over_the_codes_stays_within_the_bound(on_the_cpu):
    """Long context: a 16384-token prompt, then compiled steps whose attention reads the codes (on a GPU the
    kernel splits the 16k keys across programs and merges them), each step within the bound of the fake-quantized
    cache, as at 8 tokens."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    length = 16384
    model = decoder("llama", max_position_embeddings=length + 8).to(device)
    prompt = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(3)).to(device)
    steps = STEPS[:1, :4].to(device)
    run = lambda m, forward, **kwargs: static_decode(m, forward, prompt, steps, max_len=length + 4, **kwargs)
    fake = run(model, model, cache_class=FakeQuantizedCache)
    wide = copy.deepcopy(model).float()
    exact = run(wide, wide, cache_class=FakeQuantizedCache)
    unquantized = run(model, model)
    got = run(model, compiled_graphs(model)[0], cache_class=FP8StaticCache)
    for step in range(1, len(got)):  # the decode steps
        distance, bound = angle(got[step], fake[step]), 2 * angle(fake[step], exact[step])
        assert distance <= bound and distance < angle(unquantized[step], fake[step]), (step, distance, bound)


@pytest.mark.parametrize("recipe", ["fp8_row", "int4_wo"])
def test_a_quantized_model_with_the_fp8_cache_stays_within_the_fake_quantized_bound(recipe):
    model = decoder("llama")
    run = lambda m, cache: static_decode(m, traced(m), PROMPT, STEPS, cache_class=cache)
    exact = run(fake_quantized(model, recipe, exact=True), FakeQuantizedCache)
    plain = run(fake_quantized(model, recipe, exact=False), FakeQuantizedCache)
    eager = static_decode(model, model, PROMPT, STEPS)
    got = static_decode(model, compiled(model, recipe=recipe), PROMPT, STEPS, cache_class=FP8StaticCache)
    assert not within_bound(got, exact, plain, eager)


def test_bytes_per_token_are_half_a_bf16_caches_plus_the_scales():
    model = decoder("llama")
    caches = {kind: kind(config=model.config, max_cache_len=32) for kind in (T.StaticCache, FP8StaticCache)}
    for cache in caches.values():
        with torch.no_grad():
            model(input_ids=PROMPT, past_key_values=cache, use_cache=True)
    bf16_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in caches[T.StaticCache].layers)
    fp8 = caches[FP8StaticCache].layers
    fp8_bytes = sum(t.nbytes for layer in fp8 for t in (layer.keys, layer.values, layer.scales.keys,
                                                         layer.scales.values))
    dim = model.config.head_dim
    assert fp8_bytes * (2 * dim) == bf16_bytes * (dim + 4)  # per (token, KV head): D code bytes + one fp32 scale


def test_bad_arguments_are_refused_by_name():
    config = decoder("llama").config
    with pytest.raises(ValueError, match="2 layers"):
        FP8StaticCache(config=config, max_cache_len=8, kv_scales=[(1.0, 1.0)])
    with pytest.raises(ValueError, match=r"kv_scales\[1\].*finite and > 0"):
        FP8StaticCache(config=config, max_cache_len=8, kv_scales=[(1.0, 1.0), (0.0, 1.0)])
    with pytest.raises(ValueError, match="kv_scales_of needs a filled"):
        kv_scales_of(T.StaticCache(config=config, max_cache_len=8))
    hybrid = T.Lfm2Config(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                          num_hidden_layers=2, layer_types=["conv", "full_attention"], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="layer 0 is a .*Use transformers' StaticCache"):
        FP8StaticCache(config=hybrid, max_cache_len=8)


def calibrated(model) -> list[tuple[float, float]]:
    cache = T.StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(input_ids=PROMPT, past_key_values=cache, use_cache=True)
    return kv_scales_of(cache)


def test_static_scales_travel_in_the_checkpoints_kv_cache_scheme(tmp_path):
    """save_quantized writes them as compressed-tensors' kv_cache_scheme (model.layers.N.self_attn.k_scale /
    v_scale); load_quantized leaves them to the cache; kv_scales_of(path) reads them back exactly."""
    from compressed_tensors.quantization import QuantizationConfig

    model = decoder("llama")
    kv_scales = calibrated(model)
    fxquant.quantize_(model, "fp8_row")
    fxquant.save_quantized(model, tmp_path, kv_scales=kv_scales)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    scheme = QuantizationConfig.model_validate(config).kv_cache_scheme
    assert (scheme.num_bits, scheme.type, scheme.strategy, scheme.dynamic) == (8, "float", "tensor", False)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {"model.layers.1.self_attn.k_scale", "model.layers.1.self_attn.v_scale"} <= set(f.keys())  # noqa: SIM118
    assert kv_scales_of(tmp_path) == kv_scales
    loaded = fxquant.load_quantized(skeleton(model), tmp_path)
    cache = with_scales(FP8StaticCache, kv_scales_of(tmp_path))
    torch.testing.assert_close(static_decode(loaded, loaded, PROMPT, STEPS, cache_class=cache),
                               static_decode(model, model, PROMPT, STEPS, cache_class=with_scales(FP8StaticCache,
                                                                                                   kv_scales)),
                               rtol=0, atol=0)


def test_a_checkpoint_without_kv_scales_and_a_wrong_count_are_refused(tmp_path):
    model = decoder("llama")
    fxquant.quantize_(model, "fp8_row")
    with pytest.raises(ValueError, match="1 kv_scales pairs for the 2 attention layers"):
        fxquant.save_quantized(model, tmp_path, kv_scales=[(1.0, 1.0)])
    fxquant.save_quantized(model, tmp_path)
    with pytest.raises(ValueError, match="no per-tensor fp8 kv_cache_scheme"):
        kv_scales_of(tmp_path)
