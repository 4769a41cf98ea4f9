"""fxquant.quantize_: linears replaced in place by QuantizedLinear, high-precision weights freed; the model runs
eagerly, compiles under backend="fxquant" (fused, not quantized again) and Inductor, exports, and keeps its state
through state_dict, deepcopy and dtype/device moves. And the backend keeps one quantized copy per weight for every
graph of a model."""

import copy
import re
import warnings

import pytest
import torch
from hf_models import compiled_results, cosine, decoder, fake_quantized, static_decode, within_bound
from test_real_models import PROMPT, STEPS, Router

import fxquant
from fxquant.config import RECIPES

RECIPE_NAMES = list(RECIPES)


def storages(tensors) -> dict[int, int]:
    """Unique storages among tensors: data pointer -> bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def model_storages(model) -> dict[int, int]:
    return storages([*model.parameters(), *model.buffers()])


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_quantize_in_place_frees_weights_and_runs_the_quantized_model(recipe):
    model = decoder("llama")
    exact = fake_quantized(model, recipe, exact=True)
    bf16_bytes = sum(model_storages(model).values())
    returned = fxquant.quantize_(model, {"recipe": recipe})
    assert returned is model
    swapped = [name for name, m in model.named_modules() if isinstance(m, fxquant.QuantizedLinear)]
    assert len(swapped) == 7 * 2 and not isinstance(model.lm_head, fxquant.QuantizedLinear)
    ideal = sum(p.numel() * p.element_size() for n, p in model.named_parameters())
    assert sum(model_storages(model).values()) - sum(b.numel() * b.element_size() for b in model.buffers()) == ideal
    assert ideal < bf16_bytes
    with torch.no_grad():
        got, want = model(PROMPT, use_cache=False).logits, exact(PROMPT, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops on the reference's dequantized operands


@pytest.mark.parametrize("recipe", ["fp8_block", "int4_wo"])
def test_quantized_model_compiles_without_quantizing_again(recipe, capsys):
    model = decoder("llama")
    exact_model, plain_model = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)
    eager = static_decode(model, model, PROMPT, STEPS)
    fxquant.quantize_(model, {"recipe": recipe})
    before = model_storages(model)
    forward, graphs = compiled_results(model, {"inner": "eager", "report": True})
    got = static_decode(model, forward, PROMPT, STEPS)  # prefill and decode graphs
    exact = static_decode(exact_model, exact_model, PROMPT, STEPS)
    plain = static_decode(plain_model, plain_model, PROMPT, STEPS)
    assert not within_bound(got, exact, plain, eager)
    assert len(graphs) == 2 and all(not any(layer.recipe for layer in g.layers) for g in graphs)
    targets = [str(n.target) for n in graphs[0].gm.graph.nodes]
    if RECIPES[recipe].kind == "fp8":
        assert targets.count("fxquant.add_norm_quant_fp8.default") == 3  # norms fused around quantize_'s layers
    gemms = sum(t.startswith(("fxquant.linear", "fxquant.scaled_mm")) for t in targets)
    assert gemms == 4 * 2  # q/k/v and gate/up merged, in both layers
    # Merged, the model's parameters are views of the graphs' stacked weights: no weight bytes were added.
    after = storages([*model.parameters(), *model.buffers(), *(t for g in graphs for t in g.gm.buffers())])
    assert sum(after.values()) <= sum(before.values())
    assert "weights quantized before compile (quantize_)" in capsys.readouterr().out


@pytest.mark.cpu_only
def test_quantized_model_compiles_under_inductor_and_exports():
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    with torch.no_grad():
        want = model(PROMPT, use_cache=False).logits
        torch._dynamo.reset()
        got = torch.compile(model)(PROMPT, use_cache=False).logits
        assert cosine(got, want) > 0.9999
        ep = fxquant.export(model, (PROMPT,), {"use_cache": False}, config={"recipe": "int8_wo"})
        assert cosine(ep.module()(PROMPT, use_cache=False).logits, want) > 0.9999


def test_state_dict_deepcopy_and_moves_keep_the_quantized_weights():
    model = fxquant.quantize_(decoder("llama"), {"recipe": "fp8_row"})
    with torch.no_grad():
        want = model(PROMPT, use_cache=False).logits
        other = fxquant.quantize_(decoder("llama", seed=1), {"recipe": "fp8_row"})
        other.load_state_dict(model.state_dict())
        assert torch.equal(other(PROMPT, use_cache=False).logits, want)
        assert torch.equal(copy.deepcopy(model)(PROMPT, use_cache=False).logits, want)
        layer = model.model.layers[0].mlp.down_proj
        codes, scale = layer.weight.clone(), layer.weight_scale.clone()
        model.float()  # a dtype change reaches activations and biases, never codes and scales
        assert layer.weight.dtype == torch.float8_e4m3fn and torch.equal(layer.weight_scale, scale)
        assert torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
        assert cosine(model(PROMPT, use_cache=False).logits, want) > 0.999


def test_skeleton_on_meta_loads_a_state_dict():
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int4_wo"})
    layer = model.model.layers[1].mlp.up_proj
    skeleton = fxquant.QuantizedLinear.empty(layer.in_features, layer.out_features, "int4_wo", bias=False,
                                             dtype=torch.bfloat16, device="meta")
    skeleton.load_state_dict(layer.state_dict(), assign=True)
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(skeleton(x), layer(x))


def test_routers_and_tied_weights_stay_in_high_precision(capsys):
    router = Router().to(torch.bfloat16).eval()
    fxquant.quantize_(router, {"recipe": "fp8_row", "report": True},
                      example_inputs=(torch.randn(4, 256, dtype=torch.bfloat16),))
    assert isinstance(router.proj, torch.nn.Linear) and isinstance(router.block.gate, fxquant.QuantizedLinear)
    tied = fxquant.quantize_(decoder("qwen2", tie_word_embeddings=True), {"recipe": "int8_wo", "default_skip": ()})
    assert isinstance(tied.lm_head, torch.nn.Linear) and tied.lm_head.weight is tied.model.embed_tokens.weight
    report = capsys.readouterr().out
    assert "router: its output selects experts" in report


def test_every_graph_of_a_model_shares_one_quantized_copy():
    """Prefill and decode are two graphs; the backend's quantized weights (merged q/k/v and gate/up included) are
    stored once for both."""
    model = decoder("llama")
    forward, graphs = compiled_results(model, {"recipe": "int4_wo", "inner": "eager"}, keep=lambda result: result.gm)
    static_decode(model, forward, PROMPT, STEPS)
    assert len(graphs) == 2
    first, second = (storages(gm.buffers()) for gm in graphs)
    assert set(second) <= set(first) | set(model_storages(model))  # the second graph added no weight storage
    quantized = [b for gm in graphs for name, b in gm.named_buffers() if re.search(r"qdata(_merged\d)?$", name)]
    assert len(quantized) == 2 * 2 * 4  # each graph reads its 4 GEMMs' codes in each layer


@pytest.mark.cpu_only
def test_a_recompile_under_inductor_after_merging_into_the_models_parameters():
    """Merged q/k/v leave the model's parameters as views at storage offsets; a dynamic-shape recompile used to
    fakify them as graph inputs and fail. Inductor rounds the rest of the model its own way, so the outputs are
    bounded by the fake-quantized copies (hf_models.within_bound)."""
    model = decoder("llama")
    exact_model = fake_quantized(model, "fp8_row", exact=True)
    plain_model = fake_quantized(model, "fp8_row", exact=False)
    unquantized = copy.deepcopy(model)
    fxquant.quantize_(model, {"recipe": "fp8_row"})
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fxquant", options={"recipe": "fp8_row"})
    with torch.no_grad():
        for batch in (1, 3):  # the second batch size recompiles with dynamic shapes
            ids = torch.randint(0, 512, (batch, 16), generator=torch.Generator().manual_seed(batch))
            got, exact, plain, eager = (m(ids, use_cache=False).logits.float()[None]
                                        for m in (fn, exact_model, plain_model, unquantized))
            assert not within_bound(got, exact, plain, eager)


def test_load_state_dict_after_compile_reaches_the_compiled_graph():
    """After merging, the model's parameters are views of the graph's stacked weights: loading new weights in place
    updates what the compiled graph reads, with no recompile and no stale weights."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    other = fxquant.quantize_(decoder("llama", seed=1), {"recipe": "int8_wo"})
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fxquant", options={"inner": "eager"})
    with torch.no_grad():
        before = fn(PROMPT, use_cache=False).logits
        model.load_state_dict(other.state_dict())
        after = fn(PROMPT, use_cache=False).logits
        want = other(PROMPT, use_cache=False).logits
    assert not torch.equal(before, after)
    assert cosine(after, want) > 0.99999


def test_quantize_report_totals_every_parameter_once(capsys):
    """The tied lm_head's weight is its embedding's: counted once, as the kept linear."""
    model = decoder("qwen2", tie_word_embeddings=True)
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a tied one once
    fxquant.quantize_(model, {"recipe": "int8_wo", "report": True})
    report = capsys.readouterr().out
    assert f"of {total:,} bytes" in report
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert f"{total:,} -> {after:,} bytes" in report


def test_quantize_in_place_with_auto_measures_on_the_example_inputs():
    model = decoder("llama")
    with pytest.raises(ValueError, match="recipe='auto' needs example_inputs"):
        fxquant.quantize_(model, {"recipe": "auto"})
    report = fxquant.inspect(model, (PROMPT,), {"recipe": "auto", "min_sqnr_db": 25})
    fxquant.quantize_(model, {"recipe": "auto", "min_sqnr_db": 25}, example_inputs=(PROMPT,))
    for name, module in model.named_modules():
        if isinstance(module, fxquant.QuantizedLinear):
            assert module.recipe == report.config.recipe_for(name)
    assert any(isinstance(m, fxquant.QuantizedLinear) for m in model.modules())


def test_a_second_quantize_with_another_recipe_keeps_the_first_and_says_so(capsys):
    """It was silently ignored, and its report said "quantized 0 of ... bytes"."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int4_wo"})
    codes = model.model.layers[0].mlp.up_proj.weight
    with pytest.warns(UserWarning, match=r"keeps 14 layer\(s\) already quantized under another recipe.*"
                                         r"model\.layers\.0\.self_attn\.q_proj \(int4_wo\).*round twice.*Fix:"):
        fxquant.quantize_(model, {"recipe": "fp8_row", "report": True})
    assert model.model.layers[0].mlp.up_proj.weight is codes and model.model.layers[0].mlp.up_proj.recipe == "int4_wo"
    report = capsys.readouterr().out
    lines = report.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("model.layers.0.mlp.up_proj "))
    assert "int4_wo" in lines[row] and lines[row + 1].strip() == "already quantized, kept"
    assert "weight SQNR -: quantized before this call" in report
    quantized, total = map(lambda n: int(n.replace(",", "")),
                           re.search(r"weights: quantized ([\d,]+) of ([\d,]+) bytes", report).groups())
    assert quantized == sum(p.numel() * p.element_size() for m in model.modules()
                            if isinstance(m, fxquant.QuantizedLinear) for p in m.parameters()) and total > quantized
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same recipe again, or the layers skipped: nothing to say
        fxquant.quantize_(model, {"recipe": "int4_wo"})
        fxquant.quantize_(model, {"recipe": "fp8_row", "skip": [r"layers\."]})


def test_quantize_warns_naming_each_layer_its_shape_keeps_in_high_precision():
    """quantize_ said nothing where the backend's lint warned: a Linear(200, 200) under int4_wo stayed in bf16
    silently. One warning now names each layer kept for its shape, with the alignment it needs."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 200), torch.nn.Linear(200, 200))
    with pytest.warns(UserWarning, match="numerics lint") as caught:
        fxquant.quantize_(model.to(torch.bfloat16), "int4_wo")
    message = str(caught[0].message)
    assert "1: stays in high precision: alignment: needs K % 128 == 0" in message
    assert "2: stays in high precision: alignment" in message and "0:" not in message
    assert isinstance(model[0], fxquant.QuantizedLinear) and isinstance(model[2], torch.nn.Linear)


def test_quantize_refuses_a_non_finite_weight_by_name_before_changing_anything():
    """A weight holding inf was quantized without a word and its outputs turned NaN; the backend refuses it. So does
    quantize_ now, naming the layer, and the model is left as it was (no layer half swapped)."""
    model = decoder("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = float("inf")
    with pytest.raises(fxquant.NumericsError, match=r"model\.layers\.1\.mlp\.down_proj: weight holds 1 inf/NaN"):
        fxquant.quantize_(model, "fp8_row")
    assert not any(isinstance(m, fxquant.QuantizedLinear) for m in model.modules())


def test_quantize_report_gives_each_layers_weight_sqnr_as_the_backend_does(capsys):
    model = decoder("llama")
    fxquant.quantize_(model, {"recipe": "int4_wo", "report": True})
    lines = capsys.readouterr().out.splitlines()
    q_proj = next(line for line in lines if line.startswith("model.layers.0.self_attn.q_proj"))
    sqnr, worst = re.fullmatch(r".* (\d+\.\d) \((\d+\.\d)\)", q_proj).groups()
    assert 15 < float(worst) <= float(sqnr) < 30  # int4 in groups of 128 keeps about 20 dB


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_row", "int4_wo", "nvfp4_wo"])
def test_quantize_in_place_peaks_at_the_model_and_one_weight(recipe):
    """quantize_ holds one weight's temporaries at a time, a chunk of rows at a time: its peak past the bf16 model's
    bytes stays within the largest weight's bf16 bytes and 96 MiB for a chunk (the FP4 encoders' dozen fp32
    temporaries of CHUNK_ELEMENTS), where measuring each weight whole held four fp64 copies of it (16x its bf16
    bytes: 249-331 MB past the model here, against a bound of 134)."""
    import transformers as T

    config = T.LlamaConfig(hidden_size=1024, intermediate_size=16384, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, vocab_size=1024)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config).to("cuda", torch.bfloat16)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fxquant.quantize_(model, {"recipe": recipe})
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= largest + 96 * 2**20
