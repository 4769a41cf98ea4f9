"""On the GPU, at Llama-3-8B's heads: a decode step compiled under backend="fxquant" (nothing quantized, 2 layers, a
4096-token static cache, a left-padded batch) runs fxquant's decode attention in its graph, over a bf16 cache and
over fxquant.FP8StaticCache's codes, from SDPA and from transformers' eager attention, within twice bf16's own
distance of the eager copy it must equal."""

import copy

import pytest
import torch
import transformers as T
from hf_models import angle, compiled_results, static_decode
from test_kv_cache import FakeQuantizedCache, count

from fxquant.modules.kv_cache import FP8StaticCache

pytestmark = pytest.mark.gpu
MAX_LEN = 4096


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def llama_3_heads(request):
    config = T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                           num_hidden_layers=2, vocab_size=32000, max_position_embeddings=8192,
                           attn_implementation=request.param)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = T.LlamaForCausalLM(config).to(torch.bfloat16).eval()
        prompt, steps = torch.randint(0, 32000, (4, 64)), torch.randint(0, 32000, (4, 3))
    padding = torch.ones(4, 64, dtype=torch.long, device="cuda")
    padding[0, :9] = 0
    return model, prompt, steps, padding


@pytest.mark.parametrize("cache_class", [T.StaticCache, FP8StaticCache], ids=["bf16_cache", "fp8_cache"])
def test_a_compiled_decode_step_attends_with_the_kernel(llama_3_heads, cache_class):
    model, prompt, steps, padding = llama_3_heads
    reference_cache = T.StaticCache if cache_class is T.StaticCache else FakeQuantizedCache
    decode = lambda m, forward, cache: static_decode(m, forward, prompt, steps, max_len=MAX_LEN, padding=padding,
                                                     cache_class=cache)
    forward, graphs = compiled_results(model, {"inner": "eager", "include": []}, keep=lambda result: result.gm)
    got = decode(model, forward, cache_class)
    eager = decode(model, model, reference_cache)
    wide = copy.deepcopy(model).float()
    exact = decode(wide, wide, reference_cache)
    del wide
    assert count(graphs[-1], torch.ops.fxquant.decode_attention.default) == model.config.num_hidden_layers
    for step in range(len(got)):
        distance, bound = angle(got[step], eager[step]), 2 * angle(eager[step], exact[step])
        assert distance <= bound, f"step {step}: {distance:.2e} rad from eager, bound {bound:.2e}"
    if cache_class is FP8StaticCache:  # nearer the fake-quantized cache than the bf16 cache is
        unquantized = decode(model, model, T.StaticCache)
        assert all(angle(got[i], eager[i]) < angle(unquantized[i], eager[i]) for i in range(1, len(got)))
