"""What a decode layer launches, counted on the graph the pipeline hands Inductor: a layer's nodes are fxquant's ops
and views of their outputs, nothing Inductor would make a kernel of. Counted as the difference between a model of
three layers and one of two, so the step's own work (embedding, mask, rotary angles, the head) cancels out."""

import functools
import operator

import pytest
import torch
import transformers as T
from hf_models import compiled_results, decoder, static_decode

import fxquant
from fxquant.compile import pipeline
from fxquant.passes.decode_attention import DecodeAttention
from fxquant.passes.fuse_rotary_cache import FuseRotaryCache
from fxquant.passes.spellings import target_of

VIEWS = {operator.getitem, torch.ops.aten.slice.Tensor, torch.Tensor.view, torch.Tensor.transpose,
         torch.Tensor.unsqueeze, torch.Tensor.expand, torch.Tensor.reshape}
FP8_ROW_LAYER = sorted(["scaled_mm_fp8"] * 4 + ["rotary_cache_append", "decode_attention_quantize_fp8",
                                                "add_norm_quant_fp8", "add_norm_quant_fp8", "silu_mul_quantize_fp8"])


@pytest.fixture
def on_the_cpu(monkeypatch):
    """decode_attention and fuse_rotary_cache rewrite a CPU graph as they rewrite a GPU's."""
    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))
    monkeypatch.setattr(pipeline, "FuseRotaryCache", functools.partial(FuseRotaryCache, devices=("cpu",)))


def launches(layers: int, cache_class=T.StaticCache) -> list[str]:
    """The computing nodes (not views) of an fp8_row Llama decode step of `layers` layers over a cache of
    cache_class, by target name."""
    model = decoder("llama", num_hidden_layers=layers)
    forward, graphs = compiled_results(model, options={"recipe": "fp8_row", "inner": "eager"},
                                       keep=lambda result: result.gm)
    generator = torch.Generator().manual_seed(2)
    static_decode(model, forward, torch.randint(0, 512, (1, 5), generator=generator),
                  torch.randint(0, 512, (1, 1), generator=generator), cache_class=cache_class)
    nodes = [node for node in graphs[-1].graph.nodes if node.op in ("call_function", "call_method")]
    return [getattr(node.target, "__name__", str(node.target)).split(".")[0] for node in nodes
            if target_of(node) not in VIEWS]


def test_an_fp8_row_decode_layer_launches_nine_ops(on_the_cpu):
    """Four GEMMs, the rotary + cache write (which also grows the layer's cache length), attention with the
    o-projection's quantizer, the two residual norms with theirs and SiLU x up with its: no kernel of Inductor's."""
    two, three = launches(2), launches(3)
    layer = list(three)
    for name in two:
        layer.remove(name)
    assert sorted(layer) == FP8_ROW_LAYER, layer


def test_over_an_fp8_cache_a_layer_launches_the_same_nine_ops(on_the_cpu):
    """The e4m3 cache's rotary op quantizes K and V as it writes them: no quantizer of its own, and attention reads
    the codes."""
    two, three = launches(2, fxquant.FP8StaticCache), launches(3, fxquant.FP8StaticCache)
    layer = list(three)
    for name in two:
        layer.remove(name)
    assert sorted(layer) == sorted(name.replace("rotary_cache_append", "rotary_cache_append_e4m3")
                                   for name in FP8_ROW_LAYER), layer
