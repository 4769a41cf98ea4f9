"""merge_linear: q/k/v and gate/up of an HF Llama become one GEMM each, with the same numbers and weight bytes."""

import warnings
from collections import Counter

import pytest
import torch
from hf_models import compiled_results
from torch.fx.passes.infra.pass_base import PassResult
from transformers import LlamaConfig, LlamaForCausalLM

from fxquant.compile.pipeline import run_pipeline
from fxquant.compile.report import format_report
from fxquant.config import QuantConfig
from fxquant.passes.annotations import fake_value
from fxquant.passes.merge_linear import MergeLinear
from fxquant.passes.state import PipelineState

GEMMS = (torch.ops.fxquant.scaled_mm_fp8.default, torch.ops.fxquant.linear_fp8.default,
         torch.ops.fxquant.linear_weight_only.default)
MERGING = ["fp8_block", "fp8_row", "int8_wo", "int4_wo", "mxfp4_wo"]


@pytest.fixture(scope="module")
def llama():
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=300)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval(), torch.randint(0, 300, (2, 8))


def pipeline(model, ids, recipe):
    """The pipeline's result on the model's dynamo graph, and the logits its graph computes."""
    forward, results = compiled_results(model, {"recipe": recipe, "inner": "eager"}, fullgraph=True)
    with torch.no_grad():
        logits = forward(ids, use_cache=False).logits
    return results[0], logits


def targets(gm):
    return Counter(node.target for node in gm.graph.nodes)


@pytest.mark.parametrize("recipe", MERGING)
def test_qkv_and_gate_up_become_one_gemm_each_with_the_same_numbers(llama, recipe, monkeypatch):
    model, ids = llama
    merged, logits = pipeline(model, ids, recipe)
    counts = targets(merged.gm)
    # q/k/v -> 1, gate/up -> 1, o and down alone: 4 GEMMs where there were 7; 5 slices give the old outputs.
    assert sum(counts[op] for op in GEMMS) == 4
    assert counts[torch.ops.aten.slice.Tensor] == 5
    assert [layer.rows for layer in merged.layers if layer.rows] == [
        (0, 256, 512), (256, 384, 512), (384, 512, 512), (0, 512, 1024), (512, 1024, 1024)]

    monkeypatch.setattr(MergeLinear, "call", lambda self, gm: PassResult(gm, False))
    apart, logits_apart = pipeline(model, ids, recipe)
    assert sum(targets(apart.gm)[op] for op in GEMMS) == 7
    # The same dot products with the same scales; the CPU reference sums each in the same order either way.
    assert torch.equal(logits, logits_apart)
    weight_bytes = lambda result: sum(b.numel() * b.element_size() for name, b in result.gm.named_buffers()
                                      if name.startswith("_fxq_"))
    assert weight_bytes(merged) == weight_bytes(apart)


def test_the_report_says_which_rows_of_a_merged_gemm_a_layer_is(llama):
    model, ids = llama
    result, _ = pipeline(model, ids, "fp8_block")
    lines = format_report(result.layers).splitlines()
    note = {line.split()[0]: lines[i + 1] for i, line in enumerate(lines[:-1]) if line.startswith("model.")}
    k_proj = next(name for name in note if name.endswith("0.self_attn.k_proj"))
    o_proj = next(name for name in note if name.endswith("0.self_attn.o_proj"))
    assert note[k_proj].strip() == "rows 256:384 of a merged 512-row GEMM"
    assert "merged" not in note[o_proj]


def test_merged_gemms_and_their_slices_carry_fake_values(llama):
    model, ids = llama
    result, _ = pipeline(model, ids, "fp8_row")
    merged = [n for n in result.gm.graph.nodes if n.target is torch.ops.fxquant.scaled_mm_fp8.default
              and any(user.target is torch.ops.aten.slice.Tensor for user in n.users)]  # down_proj's stands alone
    widths = sorted(fake_value(n).shape[-1] for n in merged)
    assert widths == [512, 1024]  # q/k/v: 256 + 128 + 128; gate/up: 512 + 512
    for node in merged:
        parts = [user for user in node.users if user.target is torch.ops.aten.slice.Tensor]
        assert sum(fake_value(p).shape[-1] for p in parts) == fake_value(node).shape[-1]
        assert all(fake_value(p).stride(-2) == fake_value(node).shape[-1] for p in parts)


def test_a_second_run_changes_nothing(llama):
    model, ids = llama
    result, _ = pipeline(model, ids, "fp8_block")
    assert not MergeLinear(PipelineState(result.config, layers=result.layers))(result.gm).modified


@pytest.mark.parametrize("recipe", ["fp8_tensor", "nvfp4_wo"])
def test_one_scale_per_tensor_keeps_gemms_apart(llama, recipe):
    model, ids = llama
    result, _ = pipeline(model, ids, recipe)
    assert sum(targets(result.gm)[op] for op in GEMMS) == 7 and not any(layer.rows for layer in result.layers)


class TwoProjections(torch.nn.Module):
    """Two linears on the raw input: no norm, so each gets its own activation quantizer."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q, self.k = torch.nn.Linear(256, 256, bias=bias), torch.nn.Linear(256, 128, bias=bias)

    def forward(self, x):
        return self.q(x).sum(-1) + self.k(x).sum(-1)


def two_projections(recipe, bias):
    torch.manual_seed(0)
    model, x = TwoProjections(bias).to(torch.bfloat16), torch.randn(4, 256, dtype=torch.bfloat16)
    results = []
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=lambda gm, inputs: results.append(
            run_pipeline(gm, QuantConfig(recipe=recipe), inputs)) or results[-1].gm.forward)(x)
    return targets(results[0].gm), out


def test_biased_siblings_stay_apart():
    counts, _ = two_projections("fp8_row", bias=True)
    assert counts[torch.ops.aten.slice.Tensor] == 0 and counts[torch.ops.fxquant.scaled_mm_fp8.default] == 2
    assert counts[torch.ops.fxquant.quantize_fp8.default] == 1  # the one activation is quantized once


def test_siblings_without_a_norm_share_one_quantizer_then_merge(monkeypatch):
    counts, out = two_projections("fp8_block", bias=False)
    assert counts[torch.ops.fxquant.linear_fp8.default] == 1 and counts[torch.ops.aten.slice.Tensor] == 2
    # One scale per tensor: the quantizer is shared, the GEMMs stay two.
    counts = two_projections("fp8_tensor", bias=False)[0]
    assert counts[torch.ops.fxquant.quantize_fp8.default] == 1 and counts[torch.ops.fxquant.scaled_mm_fp8.default] == 2
    monkeypatch.setattr(MergeLinear, "call", lambda self, gm: PassResult(gm, False))
    apart_counts, apart = two_projections("fp8_block", bias=False)
    assert apart_counts[torch.ops.fxquant.linear_fp8.default] == 2 and torch.equal(out, apart)


def test_a_changed_weight_is_requantized_into_its_rows_of_the_merged_buffer(llama):
    model, ids = llama
    attention = model.model.layers[0].self_attn
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fxquant", fullgraph=True, options={"recipe": "fp8_row", "inner": "eager"})
    saved = attention.k_proj.weight.detach().clone()
    try:
        with torch.no_grad():
            fn(ids, use_cache=False)
            attention.k_proj.weight.mul_(-3.0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = fn(ids, use_cache=False).logits
            torch._dynamo.reset()
            fresh = torch.compile(model, backend="fxquant", fullgraph=True,
                                  options={"recipe": "fp8_row", "inner": "eager"})(ids, use_cache=False).logits
    finally:
        with torch.no_grad():
            attention.k_proj.weight.copy_(saved)
    assert any("k_proj changed after compile" in str(w.message) for w in caught)
    assert torch.equal(out, fresh)
