"""Mixture-of-experts models built from small configs (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, GPT-OSS
with transposed, biased experts and its own gate): expert weights found in every form transformers 5.x runs them,
quantized expert by expert, reported, and bounded by an independent fake-quantized copy of the model."""

import copy
import dataclasses
import json
import re
import warnings
from collections.abc import Callable
from typing import NamedTuple

import pytest
import route_ties
import safetensors.torch
import torch
from hf_models import VOCAB, angle, compiled, decoder, fake_quantized, skeleton, static_decode, traced, within_bound
from reports import layer_rows

import fxquant
from fxquant.modules.quantized_experts import QuantizedExperts
from fxquant.numerics import reference as R
from fxquant.quantization.weight_quantization import quantize_weight

MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"]
RECIPES = ["fp8_block", "mxfp4_wo", "int4_wo"]  # fp8_block is in no CI set below: its experts take the longest


def pairs(archs: list[str], recipes: list[str], in_ci: set[tuple[str, str]]) -> list:
    """Every (arch, recipe) case; those outside `in_ci` are marked cpu_matrix (slow, CPU only), so CI's two cores
    run one case of each test below (Mixtral int4_wo, Qwen2-MoE mxfp4_wo), `.ci/gpu --cpu-matrix` the rest."""
    return [pytest.param(arch, recipe, marks=() if (arch, recipe) in in_ci else pytest.mark.cpu_matrix)
            for arch in archs for recipe in recipes]


class ExpertMlp(torch.nn.Module):
    def __init__(self, hidden, intermediate):
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, intermediate, bias=False)
        self.w3 = torch.nn.Linear(hidden, intermediate, bias=False)
        self.w2 = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class ModuleListMoe(torch.nn.Module):
    """Older Mixtral code and many community models: a ModuleList of per-expert linears, a loop over experts with
    data-dependent token selection (torch.where), which breaks dynamo's graph inside the loop."""

    def __init__(self, hidden=256, intermediate=512, experts=4, top_k=2):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList(ExpertMlp(hidden, intermediate) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x):
        weights, chosen = torch.softmax(self.gate(x), -1, dtype=torch.float).topk(self.top_k, -1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = torch.nn.functional.one_hot(chosen, len(self.experts)).permute(2, 1, 0)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask[e])
            out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out
GENERATOR = torch.Generator().manual_seed(3)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 4), generator=GENERATOR)


def expert_parameters(model):
    return {name: p for name, p in model.named_parameters() if name.endswith(("gate_up_proj", "down_proj"))}


class Bounds(NamedTuple):
    """Static-cache decode logits of the model under test and of its copies (hf_models.within_bound), and how the
    copies were decoded, which the routing ties' alternatives repeat."""
    got: torch.Tensor
    exact: torch.Tensor
    plain: torch.Tensor
    eager: torch.Tensor
    decode: Callable
    exact_model: torch.nn.Module
    plain_model: torch.nn.Module

    def failures(self) -> list[str]:
        """The bound's failed checks, an MoE routing tie's other choice taken as correct (route_ties.within_bound)."""
        return route_ties.within_bound(self.got, self.exact, self.plain, self.eager, self.decode, self.exact_model,
                                       self.plain_model)


def bounds(model, recipe, forward, compiled_forward=True) -> Bounds:
    """The decodes that bound `forward`'s; where it is a compiled one, the copies and eager run through dynamo too
    (hf_models.traced), so that only the quantized products tell them apart."""
    got = static_decode(model, forward, PROMPT, STEPS)
    run = traced if compiled_forward else (lambda m: m)
    decode = lambda m: static_decode(m, run(m), PROMPT, STEPS)
    exact_model, plain_model = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)
    return Bounds(got, decode(exact_model), decode(plain_model), decode(model), decode, exact_model, plain_model)


@pytest.mark.parametrize("arch, recipe", pairs(MOE, RECIPES, {("qwen2_moe", "mxfp4_wo")}))
def test_experts_are_quantized_reported_and_within_the_bound(arch, recipe, capsys):
    model = decoder(arch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decoded = bounds(model, recipe, compiled(model, recipe=recipe, report=True))
    assert not [w for w in caught if re.search(r"3-D expert weights|experts run outside", str(w.message))]
    assert not decoded.failures()
    report = capsys.readouterr().out
    for name, param in expert_parameters(model).items():
        row = layer_rows(report)[name.removesuffix(".weight")]
        transposed = getattr(model.get_submodule(name.rpartition(".")[0]), "is_transposed", False)
        experts, n, k = param.shape if not transposed else (param.shape[0], param.shape[2], param.shape[1])
        assert recipe in row and f"{experts}x{n}x{k}" in row  # the report's [E,] N, K
    assert "3-D expert weights" not in report
    assert "router: its output selects experts" in report


@pytest.mark.parametrize("implementation, dtype", [
    pytest.param("grouped_mm", torch.bfloat16, id="grouped_mm-bf16"),
    pytest.param("grouped_mm", torch.float32, id="grouped_mm-fp32", marks=pytest.mark.cpu_matrix),
    pytest.param("batched_mm", torch.bfloat16, id="batched_mm-bf16", marks=pytest.mark.cpu_matrix),
    pytest.param("batched_mm", torch.float32, id="batched_mm-fp32", marks=pytest.mark.cpu_matrix)])
def test_every_experts_implementation_in_a_graph_is_quantized(implementation, dtype):
    """grouped_mm (torch's in bf16, transformers' fallback op in fp32) and batched_mm (bmm of W[ids]) are
    quantized. In fp32 the plain and exact copies coincide, so the bound is fp32 rounding: 1e-5 rad."""
    model = decoder("mixtral", dtype)
    model.set_experts_implementation(implementation)
    decoded = bounds(model, "int4_wo", compiled(model, recipe="int4_wo"))
    got, exact, eager = decoded.got, decoded.exact, decoded.eager
    if dtype == torch.bfloat16:
        assert not decoded.failures()
    else:
        for step in range(len(got)):
            assert angle(got[step], exact[step]) < min(1e-5, angle(eager[step], exact[step]))


def test_experts_outside_the_graph_are_named_with_the_fix():
    """transformers' eager experts loop breaks the graph on its routing: nothing can quantize them there."""
    model = decoder("mixtral", num_hidden_layers=1)
    model.set_experts_implementation("eager")
    with pytest.warns(UserWarning, match=r"experts run outside the compiled graph.*fxquant.quantize_"), torch.no_grad():
        compiled(model, recipe="int4_wo")(PROMPT)


@pytest.mark.parametrize("arch, recipe", pairs(["mixtral", "qwen2_moe", "gpt_oss"], RECIPES, {("mixtral", "int4_wo")}))
def test_quantize_in_place_swaps_experts_and_every_implementation_runs_them(arch, recipe):
    model = decoder(arch)
    quantized = fxquant.quantize_(copy.deepcopy(model), {"recipe": recipe}, example_inputs=(PROMPT,))
    experts = [m for m in quantized.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == model.config.num_hidden_layers
    codes = expert_parameters(quantized).values()  # the codes keep the projections' names
    assert codes and all(p.dtype in (torch.float8_e4m3fn, torch.uint8) for p in codes)
    decoded = bounds(model, recipe, quantized, compiled_forward=False)
    assert not decoded.failures()
    for implementation in ("eager", "batched_mm"):  # the quantized module ignores the setting
        quantized.set_experts_implementation(implementation)
        torch.testing.assert_close(static_decode(quantized, quantized, PROMPT, STEPS), decoded.got, rtol=0, atol=0)
    assert not bounds(model, recipe, compiled(quantized, recipe=recipe)).failures()


def test_quantize_again_leaves_quantized_experts_as_they_are_and_out_of_the_report(capsys):
    """A second quantize_ (the attention of a model whose experts a checkpoint held quantized) leaves the
    QuantizedExperts alone, as it leaves QuantizedLinear: not re-quantized, not reported as weights kept in high
    precision."""
    model = fxquant.quantize_(decoder("mixtral"), {"recipe": "mxfp4_wo", "skip": [r"self_attn"]})
    experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
    with pytest.warns(UserWarning, match=r"keeps 2 layer\(s\) already quantized under another recipe.*"
                                         r"model\.layers\.0\.mlp\.experts \(mxfp4_wo\)"):
        fxquant.quantize_(model, {"recipe": "fp8_row", "report": True})
    assert [m for m in model.modules() if isinstance(m, QuantizedExperts)] == experts
    assert isinstance(model.model.layers[0].self_attn.q_proj, fxquant.QuantizedLinear)
    rows = [row for name, row in layer_rows(capsys.readouterr().out).items() if ".experts" in name]
    assert len(rows) == 2 and all("mxfp4_wo" in row and "already quantized, kept" in row for row in rows)


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_quantized_experts_state_dict_round_trip(arch):
    model = fxquant.quantize_(decoder(arch), {"recipe": "nvfp4_wo"})
    skeleton = copy.deepcopy(model)
    for param in skeleton.parameters():
        param.data.zero_()
    skeleton.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(skeleton(PROMPT).logits, model(PROMPT).logits, rtol=0, atol=0)
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.gate_up_proj_global_scale.shape == (4,)


def test_experts_whose_shapes_contradict_their_declared_layout_stay_whole_and_say_why(capsys):
    """Experts stored transposed without saying so would be read with K and N swapped: refused, not misread."""
    model = decoder("mixtral", num_hidden_layers=1)
    experts = model.model.layers[0].mlp.experts
    experts.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj.detach().transpose(1, 2).contiguous())
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().transpose(1, 2).contiguous())
    fxquant.quantize_(model, {"recipe": "int4_wo", "report": True})
    assert not any(isinstance(m, QuantizedExperts) for m in model.modules())
    down_proj = layer_rows(capsys.readouterr().out)["model.layers.0.mlp.experts.down_proj"]
    assert "are not the layout [E, 2I, H] and [E, H, I] the module declares" in down_proj


def test_gpt_oss_experts_keep_their_biases_and_gate_and_refuse_a_checkpoint_layout_that_would_drop_them(tmp_path):
    """GPT-OSS stores its experts transposed, with a bias per expert and a clamped gate over interleaved rows.
    quantize_ keeps all three (the bound above checks the outputs); compressed-tensors' per-expert linears hold none
    of them, so save_quantized refuses with the fix, and the fix's skip pattern saves and loads the rest exactly."""
    model = decoder("gpt_oss")
    quantized = fxquant.quantize_(copy.deepcopy(model), {"recipe": "int4_wo"})
    experts = quantized.model.layers[0].mlp.experts
    original = model.model.layers[0].mlp.experts
    e, k, n = original.gate_up_proj.shape  # stored [E, K, N]
    assert experts.gate_up_proj.shape == (e, n, k // 2)  # quantized [E, N, K], two int4 codes a byte
    assert torch.equal(experts.down_proj_bias, original.down_proj_bias)
    assert experts.gate_owner.limit == original.limit and not list(experts.gate_owner.parameters())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts has expert biases.*Fix:") as caught:
        fxquant.save_quantized(quantized, tmp_path)
    pattern = re.search(r"skip=\[r'(.+?)'\]", str(caught.value)).group(1)
    kept = fxquant.quantize_(copy.deepcopy(model), {"recipe": "int4_wo", "skip": [pattern]})
    assert not any(isinstance(m, QuantizedExperts) for m in kept.modules())
    fxquant.save_quantized(kept, tmp_path)
    with fxquant.empty_weights():
        empty = type(model)(model.config).to(torch.bfloat16)
    loaded = fxquant.load_quantized(empty, tmp_path).eval()
    torch.testing.assert_close(static_decode(loaded, loaded, PROMPT, STEPS), static_decode(kept, kept, PROMPT, STEPS),
                               rtol=0, atol=0)


def test_skipped_experts_stay_whole_and_say_why(capsys):
    model = fxquant.quantize_(decoder("mixtral"), {"recipe": "int4_wo", "skip": [r"experts\.down_proj$"],
                                                   "report": True})
    assert not any(isinstance(m, QuantizedExperts) for m in model.modules())
    report = capsys.readouterr().out
    assert "model.layers.0.mlp.experts.gate_up_proj" in report and "skip option" in report


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss"])
def test_w4a8_experts_are_quantized_compiled_and_in_place(arch, capsys):
    """int4_fp8 experts (GPT-OSS's stored transposed, with biases): int4 codes times per-token e4m3 activations on
    the grouped W4A8 product, in the compiled graph and through quantize_, each decode within the fake-quantized
    bound and reported under the recipe."""
    model = decoder(arch)
    assert not bounds(model, "int4_fp8", compiled(model, recipe="int4_fp8", report=True)).failures()
    rows = layer_rows(capsys.readouterr().out)
    assert all("int4_fp8" in rows[name.removesuffix(".weight")] for name in expert_parameters(model))
    quantized = fxquant.quantize_(copy.deepcopy(model), {"recipe": "int4_fp8"})
    experts = [m for m in quantized.modules() if isinstance(m, QuantizedExperts)]
    assert len(experts) == model.config.num_hidden_layers and all(m.recipe == "int4_fp8" for m in experts)
    assert not bounds(model, "int4_fp8", quantized, compiled_forward=False).failures()


@pytest.mark.parametrize("amax, scale", [(2.7, 0.5), (5.5, 1.0), (1.2, 0.25)])
def test_mxfp4_expert_scales_follow_the_even_mode(amax, scale):
    """E8M0 scales round the amax's mantissa at 0.75 (compressed-tensors' rule) before taking the exponent:
    2.7 = 1.35 * 2 keeps 2^1 / 4 = 0.5; 5.5 = 1.375 * 4 gives 1.0; 1.2 = 1.2 * 1 gives 0.25."""
    w = torch.full((3, 16, 64), 0.01)
    w[1, 5, 32:64] = torch.linspace(-amax, amax / 2, 32)  # expert 1, row 5, second block of 32
    q = quantize_weight(w, "mxfp4_wo")
    scales = q.scale.float()
    assert scales.shape == (3, 16, 2) and float(scales[1, 5, 1]) == scale
    assert float(R.dequantize(R.expert(q, 1), torch.float32)[5, 32:].abs().max()) <= 6 * scale  # e2m1's max


def test_export_carries_the_grouped_experts_through_save_and_load(tmp_path):
    """torch.export's aten graph spells the experts' product aten._grouped_mm; the exported program runs the grouped
    ops, and saves and loads with them."""
    model = decoder("mixtral", num_hidden_layers=1)
    with torch.no_grad():
        ep = fxquant.export(model, (PROMPT,), kwargs={"use_cache": False}, config={"recipe": "int4_wo"})
        want = compiled(model, recipe="int4_wo")(PROMPT, use_cache=False).logits
        torch.export.save(ep, tmp_path / "moe.pt2")
        got = fxquant.load(tmp_path / "moe.pt2").module()(PROMPT, use_cache=False).logits
    targets = [str(node.target) for node in ep.graph.nodes]
    assert targets.count("fxquant.grouped_linear_weight_only.default") == 2
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)  # bf16 logits: a rounding apart at most


def test_mixtral_checkpoint_with_experts_kept_round_trips(tmp_path):
    """Experts kept in high precision are stored as the model holds them (3-D); a meta skeleton loads it exactly."""
    model = fxquant.quantize_(decoder("mixtral", num_hidden_layers=1), {"recipe": "fp8_block", "skip": [r"experts\."]})
    fxquant.save_quantized(model, tmp_path)
    loaded = fxquant.load_quantized(skeleton(model), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, model(PROMPT).logits, rtol=0, atol=0)
    assert isinstance(loaded.model.layers[0].self_attn.q_proj, fxquant.QuantizedLinear)


def test_per_expert_linears_in_a_module_list_are_quantized_with_each_experts_weights():
    """Each expert's MLP compiles as a graph dynamo reuses for the next expert; each runs with its own quantized
    weights, within the bound of an independent fake-quantized copy."""
    torch.manual_seed(0)
    model = ModuleListMoe().to(torch.bfloat16)
    x = torch.randn(1, 12, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x[0])
        exact = fake_quantized(model, "int4_wo", exact=True)(x[0])
        plain = fake_quantized(model, "int4_wo", exact=False)(x[0])
        with pytest.warns(UserWarning, match="reuses this compiled graph"):
            got = compiled(model, recipe="int4_wo")(x[0])
    assert not within_bound(got[None].float(), exact[None].float(), plain[None].float(), eager[None].float())


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_inspect_and_auto_measure_experts_and_pick_a_recipe_for_them(implementation, capsys):
    """recipe="auto" kept experts, most of an MoE model's bytes, in high precision; each expert product is now
    measured against its fp32 shadow on the sample routing and gets the cheapest recipe that meets the floor."""
    model = decoder("mixtral", num_hidden_layers=1)
    model.set_experts_implementation(implementation)
    report = fxquant.inspect(model, (PROMPT,), {"recipe": "auto", "min_sqnr_db": 25})
    experts = [m for m in report.layers if ".experts." in m.fqn]
    assert [m.fqn for m in experts] == ["model.layers.0.mlp.experts.gate_up_proj",
                                        "model.layers.0.mlp.experts.down_proj"]
    for m in experts:  # random weights: 4-bit schemes reach about 20 dB, fp8 about 31
        assert m.chosen_by_auto and m.recipe in ("fp8_row", "fp8_block", "fp8_tensor")
        assert m.out_sqnr >= 25 and m.weight_sqnr > 25
    with torch.no_grad():
        compiled(model, report=True, recipe="auto", layer_recipes=report.config.layer_recipes)(PROMPT)
    rows = layer_rows(capsys.readouterr().out)
    for m in experts:  # the backend quantizes each as inspect chose
        assert m.recipe in rows[m.fqn]


def test_auto_keeps_experts_it_could_not_measure_and_says_why(capsys):
    """transformers' eager experts loop runs outside the graphs recipe='auto' measures: quantize_ keeps those
    experts, naming the fix, instead of guessing a recipe."""
    model = decoder("mixtral", num_hidden_layers=1)
    model.set_experts_implementation("eager")
    fxquant.quantize_(model, {"recipe": "auto", "report": True}, example_inputs=(PROMPT,))
    assert not any(isinstance(m, QuantizedExperts) for m in model.modules())
    row = layer_rows(capsys.readouterr().out)["model.layers.0.mlp.experts.gate_up_proj"]
    assert "auto' measured no recipe for these experts" in row and "layer_recipes" in row


def _gpt_oss_mxfp4_checkpoint(model, path):
    """The model saved as GPT-OSS ships: every experts projection as random MXFP4 blocks and E8M0 scales (2^-9 to
    2^0), `quant_method: "mxfp4"`, everything else in bf16. Returns {experts projection name: (blocks, scales)}."""
    generator, tensors, stored = torch.Generator().manual_seed(5), {}, {}
    for name, param in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = param.contiguous()
            continue
        e, k, n = param.shape  # stored transposed
        blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=generator, dtype=torch.uint8)
        scales = torch.randint(118, 128, (e, n, k // 32), generator=generator, dtype=torch.uint8)
        tensors |= {name + "_blocks": blocks, name + "_scales": scales}
        stored[name] = blocks, scales
    safetensors.torch.save_file(tensors, path / "model.safetensors")
    config = model.config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (path / "config.json").write_text(json.dumps(config))
    return stored


def test_gpt_oss_mxfp4_checkpoint_loads_its_experts_as_stored(tmp_path):
    """transformers' own MXFP4 format: the experts' codes and scales are taken over as stored, and dequantize to
    what transformers' reader (`convert_moe_packed_tensors`) makes of the same bytes, bit for bit; the loaded model
    decodes as a bf16 model holding those weights, to bf16 rounding (relative error below 1e-2)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = decoder("gpt_oss")
    stored = _gpt_oss_mxfp4_checkpoint(model, tmp_path)
    with fxquant.empty_weights():
        empty = type(model)(model.config).to(torch.bfloat16)
    loaded = fxquant.load_quantized(empty, tmp_path).eval()
    reference = copy.deepcopy(model)
    for name, (blocks, scales) in stored.items():
        experts_name, _, projection = name.rpartition(".")
        experts = loaded.get_submodule(experts_name)
        assert isinstance(experts, QuantizedExperts) and experts.recipe == "mxfp4_wo"
        want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N], as the model stores it
        codes = getattr(experts, projection)
        assert torch.equal(codes.reshape(-1), blocks.reshape(-1))  # the stored bytes, reshaped
        template = quantize_weight(torch.zeros(want.transpose(1, 2).shape), "mxfp4_wo")
        got = R.dequantize_experts(dataclasses.replace(template, data=codes, scale=getattr(experts, projection +
                                                                                              "_scale")))
        assert torch.equal(got.float(), want.transpose(1, 2))
        getattr(reference.get_submodule(experts_name), projection).data = want.to(torch.bfloat16)
    got, want = static_decode(loaded, loaded, PROMPT, STEPS), static_decode(reference, reference, PROMPT, STEPS)
    error = float((got - want).norm() / want.norm())
    assert error < 1e-2, error


def test_an_mxfp4_checkpoint_missing_an_experts_scale_is_refused_by_name(tmp_path):
    model = decoder("gpt_oss", num_hidden_layers=1)
    _gpt_oss_mxfp4_checkpoint(model, tmp_path)
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    with fxquant.empty_weights():
        empty = type(model)(model.config).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"no model\.layers\.0\.mlp\.experts\.down_proj_scales.*Fix:"):
        fxquant.load_quantized(empty, tmp_path)
