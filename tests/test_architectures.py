"""A sweep over decoder families built from small configs (hf_models.SWEEP): each compiles under fp8_row and
int4_wo within the bound of its independent fake-quantized copy, and with nothing quantized decodes the tokens
the same model decodes run by dynamo alone."""

import copy
import re
import warnings

import pytest
import torch
from hf_models import SWEEP, VOCAB, compiled, decoder, fake_quantized, static_decode, traced, within_bound
from reports import layer_rows

import fxquant

GENERATOR = torch.Generator().manual_seed(4)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 2), generator=GENERATOR)
# One layer where one shows the family; two where the second layer is what differs: Falcon's second block fuses
# the first block's residual sum into two norms, DeepSeek-V3's first layer is dense and its second routed.
LAYERS = {"falcon": 2, "deepseek_v3": 2}
MOE = ("deepseek_v3", "llama4", "granitemoe", "qwen3_moe")
IN_CI = ("fp8_row", "int4_wo")  # CI's two cores run a dense family under one recipe, taken in turn
# and only the dense families whose layers differ most from Llama's (the GPU and local suites run all under both)
CI_FAMILIES = ("qwen3", "gemma3", "stablelm", "falcon", "cohere", "phi")


def small(arch):
    return decoder(arch, num_hidden_layers=LAYERS.get(arch, 1), pad_token_id=0, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("arch, recipe", [
    pytest.param(arch, recipe,
                 marks=pytest.mark.cpu_matrix if arch not in CI_FAMILIES or recipe != IN_CI[index % 2] else ())
    for index, arch in enumerate(SWEEP) for recipe in ("fp8_row", "int4_wo")])
def test_each_family_compiles_within_the_bound_of_its_fake_quantized_copy(arch, recipe, capsys):
    model = small(arch)
    got = static_decode(model, compiled(model, recipe=recipe, report=True), PROMPT, STEPS)
    report = capsys.readouterr().out
    copies = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False), model
    assert not within_bound(got, *(static_decode(m, traced(m), PROMPT, STEPS) for m in copies))
    experts = [line for line in report.splitlines() if re.match(r"\S+\s+\d+x\d+x\d+\s", line)]  # [E, N, K] rows
    assert len(experts) >= 2 * (arch in MOE) and all(recipe in row for row in experts), experts  # most weights


@pytest.mark.parametrize("arch", list(SWEEP))
def test_each_family_with_nothing_quantized_decodes_the_tokens_dynamo_alone_decodes(arch):
    """With nothing selected the passes move only reductions to fp32; the reference is the model run by dynamo with
    no compiler (hf_models.traced), since transformers takes other mask code while traced."""
    model = small(arch)
    got = static_decode(model, compiled(model, include=[]), PROMPT, STEPS)
    want = static_decode(model, traced(model), PROMPT, STEPS)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.cpu_matrix  # 60 s of CI's two cores
@pytest.mark.parametrize("recipe", ["fp8_row", "int4_wo"])
def test_llama4_dense_experts_are_quantized_in_place_and_run_eagerly_and_compiled(recipe):
    """Llama4 stores its experts [E, H, 2I] and runs every expert over every token as bmm: the backend and quantize_
    kept them in bf16 (69% of the weights), the lint blaming a graph break that was not there."""
    model = small("llama4")
    quantized = fxquant.quantize_(copy.deepcopy(model), {"recipe": recipe})
    experts = [m for m in quantized.modules() if isinstance(m, fxquant.QuantizedExperts)]
    assert len(experts) == 1 and experts[0].dense and experts[0].gate_up_proj.shape[:2] == (4, 1024)
    copies = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False), model
    eager = [static_decode(m, m, PROMPT, STEPS) for m in copies]
    assert not within_bound(static_decode(quantized, quantized, PROMPT, STEPS), *eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no lint finding: the experts are in the graph
        got = static_decode(quantized, compiled(quantized, recipe=recipe), PROMPT, STEPS)
    assert not within_bound(got, *(static_decode(m, traced(m), PROMPT, STEPS) for m in copies))


def test_a_router_that_casts_its_weight_is_reported_and_inspected(capsys):
    """DeepSeek-V3's router multiplies its weight cast to fp32: the report showed a blank shape and 0 of 0 bytes for
    it, and inspect left it out."""
    model = small("deepseek_v3")
    with torch.no_grad():
        compiled(model, recipe="fp8_row", report=True)(PROMPT)
    router = "model.layers.1.mlp.gate"
    row = layer_rows(capsys.readouterr().out)[router]
    weight = model.get_submodule(router).weight
    assert f"{weight.shape[0]}x{weight.shape[1]}" in row and f"{weight.numel() * weight.element_size():,}" in row
    assert "router" in row
    measured = {layer.fqn: layer for layer in fxquant.inspect(model, (PROMPT,), {"recipe": "fp8_row"}).layers}
    assert measured[router].recipe is None and "router" in measured[router].reason
