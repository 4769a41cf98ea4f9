"""compressed-tensors checkpoints, checked against the compressed-tensors package itself (test extra only): what its
compressors write loads into fxquant with bit-identical dequantized weights, and what fxquant writes decompresses
in compressed-tensors to fxquant's values. NVFP4's global scale is divided by there and multiplied by here (its
rounded reciprocal), which may round an element apart; on these models no element does."""

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
from compressed_tensors.quantization.utils import calculate_qparams
from compressed_tensors.quantization.utils.helpers import generate_gparam
from hf_models import decoder, skeleton
from safetensors import safe_open
from safetensors.torch import save_file
from test_real_models import PROMPT

import fxquant
from fxquant.config import RECIPES
from fxquant.io.compressed_tensors import from_checkpoint, to_checkpoint
from fxquant.numerics import reference as R
from fxquant.numerics.granularity import as_granularity
from fxquant.numerics.quantized import Quantized

INT8_CHANNEL = dict(weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True))
# compressed-tensors scheme -> (its format, the recipe fxquant computes it with)
CT_SCHEMES = {
    "FP8_DYNAMIC": (PRESET_SCHEMES["FP8_DYNAMIC"], "float-quantized", "fp8_row"),
    "FP8_BLOCK": (PRESET_SCHEMES["FP8_BLOCK"], "float-quantized", "fp8_block"),
    "W4A16_ASYM": (PRESET_SCHEMES["W4A16_ASYM"], "pack-quantized", "int4_wo"),
    "W4A16": (PRESET_SCHEMES["W4A16"], "pack-quantized", "int4_sym_wo"),
    "W4AFP8": (PRESET_SCHEMES["W4AFP8"], "pack-quantized", "int4_fp8"),
    "W8A16_CHANNEL": (INT8_CHANNEL, "pack-quantized", "int8_wo"),
    "MXFP4A16": (PRESET_SCHEMES["MXFP4A16"], "mxfp4-pack-quantized", "mxfp4_wo"),
    "NVFP4A16": (PRESET_SCHEMES["NVFP4A16"], "nvfp4-pack-quantized", "nvfp4_wo"),
    "MXFP8": (PRESET_SCHEMES["MXFP8"], "mxfp8-quantized", "mxfp8"),
}
ARCHS = ["llama", "qwen2"]


def dequantized(layer: fxquant.QuantizedLinear, dtype) -> torch.Tensor:
    """A QuantizedLinear's weight [N, K] through fxquant's reference."""
    scheme = RECIPES[layer.recipe]
    granularity = (R.default_granularity(scheme.weight_fmt) if scheme.weight_granularity is None
                   else as_granularity(scheme.weight_granularity))
    q = Quantized(layer.weight, layer.weight_scale, scheme.weight_fmt, granularity,
                  torch.Size((layer.out_features, layer.in_features)), dtype, zero_point=layer.weight_zero_point,
                  global_scale=layer.weight_global_scale)
    return R.dequantize(q, dtype)


def ct_qparams(w: torch.Tensor, args) -> dict[str, torch.Tensor]:
    """Scales, zero points (and NVFP4's global scale) as compressed-tensors computes them from a weight's minima and
    maxima."""
    n, k = w.shape
    global_scale = generate_gparam(w.amin(), w.amax()) if args.strategy == "tensor_group" else None
    if args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy in ("group", "tensor_group"):
        groups = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = groups.amin(-1), groups.amax(-1)
    else:
        blocks = w.reshape(n // 128, 128, k // 128, 128)
        lo, hi = blocks.amin((1, 3)), blocks.amax((1, 3))
    scale, zero_point = calculate_qparams(lo, hi, args, global_scale=global_scale)
    found = {"weight_scale": scale, "weight_zero_point": zero_point}
    return found if global_scale is None else {**found, "weight_global_scale": global_scale}


def save_with_config(model, tensors: dict, scheme, fmt: str, path) -> None:
    """`tensors` as the checkpoint, with config.json holding compressed-tensors' own quantization_config."""
    save_file(tensors, path / "model.safetensors")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"])
    (path / "config.json").write_text(json.dumps(
        {**model.config.to_dict(), "quantization_config": config.model_dump(mode="json", exclude_none=True)},
        default=str))


def write_with_compressed_tensors(model, preset: str, path) -> dict:
    """A checkpoint compressed-tensors' compressors write: every linear but lm_head; layer -> decompressed weight."""
    scheme_args, fmt, _ = CT_SCHEMES[preset]
    scheme = QuantizationScheme(targets=["Linear"], **scheme_args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    tensors, expected = {}, {}
    tied = model.config.tie_word_embeddings
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or not tied}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        compressed = compressor.compress({"weight": module.weight.detach(),
                                          **ct_qparams(module.weight.detach(), scheme.weights)}, scheme)
        expected[name] = compressor.decompress(dict(compressed), scheme)["weight"]
        del state[f"{name}.weight"]
        tensors.update({f"{name}.{key}": t.contiguous() for key, t in compressed.items()})
    save_with_config(model, {**tensors, **{k: v.contiguous() for k, v in state.items()}}, scheme, fmt, path)
    return expected


@pytest.mark.parametrize("preset", list(CT_SCHEMES))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_checkpoint_compressed_tensors_wrote_loads_bit_identically(tmp_path, arch, preset):
    model = decoder(arch)
    expected = write_with_compressed_tensors(model, preset, tmp_path)
    loaded = fxquant.load_quantized(skeleton(model), tmp_path)
    recipe = CT_SCHEMES[preset][2]
    for name, weight in expected.items():
        layer = loaded.get_submodule(name)
        assert isinstance(layer, fxquant.QuantizedLinear) and layer.recipe == recipe
        got = dequantized(layer, weight.dtype)
        assert torch.equal(got.view(torch.int16), weight.view(torch.int16)), name
    with torch.no_grad():
        assert torch.isfinite(loaded(PROMPT, use_cache=False).logits).all()


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("arch", ARCHS)
def test_a_checkpoint_fxquant_wrote_decompresses_in_compressed_tensors(tmp_path, arch, recipe):
    model = fxquant.quantize_(decoder(arch), {"recipe": recipe})
    fxquant.save_quantized(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(written)  # compressed-tensors parses fxquant's config
    assert config.ignore == ["lm_head"]
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    checked = 0
    for group in config.config_groups.values():
        compressor = BaseCompressor.get_value_from_registry(group.format)
        for name in group.targets:
            local = {key[len(name) + 1:]: t for key, t in stored.items() if key.startswith(name + ".")}
            weight = compressor.decompress(local, group)["weight"]  # fp32 from fp32 scales; MXFP4 in bf16, exact
            want = dequantized(model.get_submodule(name), weight.dtype)
            assert torch.equal(weight, want), name
            checked += 1
    assert checked == 7 * 2
    reloaded = fxquant.load_quantized(skeleton(model), tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT, use_cache=False).logits, model(PROMPT, use_cache=False).logits)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_loading_makes_the_stored_codes_the_layers_codes_without_a_copy(recipe):
    """Loading's peak is the quantized model only if each layer's codes are the bytes read from the file: int8's
    conversion from the stored q + 128 once copied every layer through int16 (1.83x the ideal on the GPU)."""
    layer = fxquant.QuantizedLinear.from_weight(torch.randn(256, 512, dtype=torch.bfloat16), None, recipe)
    stored = {key: t.clone() for key, t in to_checkpoint(layer, recipe).items()}
    codes = stored.get("weight_packed", stored.get("weight"))
    parts = from_checkpoint(stored, recipe, layer.out_features, "layer")
    assert parts["weight"].untyped_storage().data_ptr() == codes.untyped_storage().data_ptr()
    assert torch.equal(parts["weight"].view(torch.uint8), layer.weight.detach().view(torch.uint8))


def test_gpt2_conv1d_checkpoint_round_trip_keeps_the_tied_head(tmp_path):
    """Conv1D layers (W stored [in, out]) save as [out, in] linears and load into a meta skeleton's Conv1D slots; the
    lm_head stays tied to the embedding."""
    from test_real_models import gpt2

    model = fxquant.quantize_(gpt2(), {"recipe": "int4_wo"})
    fxquant.save_quantized(model, tmp_path)
    with torch.device("meta"):
        empty = type(model)(model.config).to(torch.bfloat16)
    loaded = fxquant.load_quantized(empty, tmp_path).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert isinstance(loaded.transformer.h[1].mlp.c_proj, fxquant.QuantizedLinear)
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, model(PROMPT).logits)


def test_a_tied_head_named_in_layer_recipes_warns_with_the_fix_which_quantizes_and_saves_it_untied(tmp_path):
    """A tied lm_head asked for by name stays in high precision with a warning that gives the fix; after the fix
    the head is quantized, the embedding keeps its weight, and the checkpoint says the two are no longer tied, so a
    skeleton built from it loads the quantized head and gives the same logits."""
    options = {"recipe": "int8_wo", "layer_recipes": {"lm_head": "fp8_row"}}
    tied = decoder("qwen2", tie_word_embeddings=True)
    with pytest.warns(UserWarning, match=r"lm_head: .*shared with model\.embed_tokens.*asks for fp8_row.*"
                                         r"torch\.nn\.Parameter\(layer\.weight\.detach\(\)\.clone\(\)\)"):
        fxquant.quantize_(tied, options)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    model = decoder("qwen2", tie_word_embeddings=True)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # the fix, as the warning gives it
    fxquant.quantize_(model, options)
    assert model.lm_head.recipe == "fp8_row" and model.model.embed_tokens.weight.dtype == torch.bfloat16
    fxquant.save_quantized(model, tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.tie_word_embeddings is False and model.config.tie_word_embeddings is True
    empty = skeleton(type(model)(config).to(torch.bfloat16))
    loaded = fxquant.load_quantized(empty, tmp_path).eval()
    assert isinstance(loaded.lm_head, fxquant.QuantizedLinear) and loaded.lm_head.recipe == "fp8_row"
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, model(PROMPT).logits)


def test_loading_leaves_nothing_on_meta_silently(tmp_path):
    """A non-persistent buffer (rotary frequencies) is in no checkpoint: loading names it and the fix."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    fxquant.save_quantized(model, tmp_path)
    with torch.device("meta"):
        empty = type(model)(model.config)
    with pytest.raises(ValueError, match=r"inv_freq.*still on the meta device.*under fxquant.empty_weights\(\)"):
        fxquant.load_quantized(empty, tmp_path)


def test_a_scheme_no_recipe_computes_is_refused_by_name(tmp_path):
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    fxquant.save_quantized(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="config group group_0: no fxquant recipe computes"):
        fxquant.load_quantized(skeleton(model), tmp_path)


def expert_weights(experts: fxquant.QuantizedExperts, e: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's gate_up [2I, H] and down [H, I] weights through fxquant's reference."""
    def projection(name, out_features, in_features):
        part = lambda suffix: getattr(experts, name + suffix)
        parts = [None if part(s) is None else part(s)[e] for s in ("", "_scale", "_global_scale", "_zero_point")]
        return dequantized(SimpleNamespace(recipe=experts.recipe, weight=parts[0], weight_scale=parts[1],
                                           weight_global_scale=parts[2], weight_zero_point=parts[3],
                                           out_features=out_features, in_features=in_features), dtype)

    hidden, inter = experts.hidden_dim, experts.intermediate_dim
    return projection("gate_up_proj", 2 * inter, hidden), projection("down_proj", hidden, inter)


def mixtral_expert_linears(name: str, e: int) -> tuple[str, str, str]:
    """Mixtral checkpoints' per-expert linears: w1 (gate), w3 (up), w2 (down) under block_sparse_moe."""
    path = name.replace(".mlp.experts", ".block_sparse_moe.experts")
    return f"{path}.{e}.w1", f"{path}.{e}.w3", f"{path}.{e}.w2"


def write_mixtral_with_compressed_tensors(model, preset: str, path) -> dict:
    """A Mixtral checkpoint as compressed-tensors' compressors write one: the attention linears and each expert's
    w1, w3 and w2, gate and up computed together so that they share NVFP4's global scale (llm-compressor fuses
    it, as vLLM needs); linear name -> decompressed weight."""
    scheme_args, fmt, _ = CT_SCHEMES[preset]
    scheme = QuantizationScheme(targets=["Linear"], **scheme_args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    state, groups = dict(model.state_dict()), []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and module.weight.shape[0] % 16 == 0:
            groups.append([(name, state.pop(f"{name}.weight"))])
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            gate_up, down = state.pop(f"{name}.gate_up_proj"), state.pop(f"{name}.down_proj")
            inter = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                w1, w3, w2 = mixtral_expert_linears(name, e)
                groups += [[(w1, gate_up[e, :inter]), (w3, gate_up[e, inter:])], [(w2, down[e])]]
    tensors, expected = {}, {}
    for group in groups:
        whole = torch.cat([w for _, w in group])
        qparams, first = ct_qparams(whole, scheme.weights), 0
        for name, w in group:
            rows = lambda t, first=first, n=w.shape[0], total=whole.shape[0]: t if t.numel() == 1 else t[
                first * t.shape[0] // total:(first + n) * t.shape[0] // total]
            compressed = compressor.compress({"weight": w, **{k: rows(v) for k, v in qparams.items()}}, scheme)
            expected[name] = compressor.decompress(dict(compressed), scheme)["weight"]
            tensors.update({f"{name}.{key}": t.clone() for key, t in compressed.items()})  # gate, up: own copies
            first += w.shape[0]
    save_with_config(model, {**tensors, **{k: v.contiguous() for k, v in state.items()}}, scheme, fmt, path)
    return expected


@pytest.mark.parametrize("preset", list(CT_SCHEMES))
def test_a_mixtral_checkpoint_compressed_tensors_wrote_loads_its_experts_bit_identically(tmp_path, preset):
    model = decoder("mixtral")
    expected = write_mixtral_with_compressed_tensors(model, preset, tmp_path)
    loaded = fxquant.load_quantized(skeleton(model), tmp_path)
    for i, layer in enumerate(loaded.model.layers):
        experts = layer.mlp.experts
        assert isinstance(experts, fxquant.QuantizedExperts) and experts.recipe == CT_SCHEMES[preset][2]
        for e in range(experts.num_experts):
            w1, w3, w2 = mixtral_expert_linears(f"model.layers.{i}.mlp.experts", e)
            gate_up, down = expert_weights(experts, e, expected[w1].dtype)
            want = torch.cat([expected[w1], expected[w3]])
            assert torch.equal(gate_up.view(torch.int16), want.view(torch.int16)), (w1, w3)
            assert torch.equal(down.view(torch.int16), expected[w2].view(torch.int16)), w2
    with torch.no_grad():
        assert torch.isfinite(loaded(PROMPT, use_cache=False).logits).all()


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_quantized_experts_fxquant_wrote_decompress_in_compressed_tensors(tmp_path, arch, recipe):
    """Experts are written as the per-expert linears transformers' checkpoints hold (Mixtral: w1 / w3 / w2 under
    block_sparse_moe; Qwen2-MoE: gate_proj / up_proj / down_proj), and read back bit for bit."""
    model = fxquant.quantize_(decoder(arch), {"recipe": recipe})
    fxquant.save_quantized(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    config = QuantizationConfig.model_validate(written)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        stored = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    qwen = ("mlp", "gate_proj", "up_proj", "down_proj")
    names = ("block_sparse_moe", "w1", "w3", "w2") if arch == "mixtral" else qwen
    group = next(iter(config.config_groups.values()))
    compressor = BaseCompressor.get_value_from_registry(group.format)
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        for e in range(experts.num_experts):
            gate, up, down = (f"model.layers.{i}.{names[0]}.experts.{e}.{n}" for n in names[1:])
            got = {}
            for linear in (gate, up, down):
                assert linear in group.targets
                local = {key[len(linear) + 1:]: t for key, t in stored.items() if key.startswith(linear + ".")}
                got[linear] = compressor.decompress(local, group)["weight"]
            gate_up, down_w = expert_weights(experts, e, got[gate].dtype)
            assert torch.equal(torch.cat([got[gate], got[up]]), gate_up) and torch.equal(got[down], down_w), (i, e)
    reloaded = fxquant.load_quantized(skeleton(model), tmp_path)
    with torch.no_grad():
        assert torch.equal(reloaded(PROMPT, use_cache=False).logits, model(PROMPT, use_cache=False).logits)


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_w4a8_row_scales_are_found_again_on_loading_where_the_scales_hold_them(tmp_path, arch):
    """int4_fp8's row scales are not stored (compressed-tensors' W4AFP8 holds the group scales): loading finds them
    again from the group scales, so fxquant's own checkpoint keeps the row-scaled GEMMs (decision 0040), while a W4A8
    checkpoint quantized otherwise (compressed-tensors' amax scales) has none and keeps the block-scaled ones."""
    model = fxquant.quantize_(decoder(arch), {"recipe": "int4_fp8"})
    fxquant.save_quantized(model, tmp_path)
    reloaded = fxquant.load_quantized(skeleton(model), tmp_path)
    rows = lambda m: {n: t for n, t in m.named_parameters() if n.endswith("row_scale")}
    assert rows(model) and rows(reloaded).keys() == rows(model).keys()
    assert all(torch.equal(rows(reloaded)[n], t) for n, t in rows(model).items())
    if arch == "llama":
        other = tmp_path / "compressed_tensors"
        other.mkdir()
        write_with_compressed_tensors(decoder(arch), "W4AFP8", other)
        loaded = fxquant.load_quantized(skeleton(decoder(arch)), other)
        layers = [m for m in loaded.modules() if isinstance(m, fxquant.QuantizedLinear)]
        assert layers and all(layer.weight_row_scale is None for layer in layers)


def rewrite(path, change) -> None:
    """Apply change(tensors) to the checkpoint's one safetensors file."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_experts_whose_gate_and_up_disagree_on_a_global_scale_are_refused_by_name(tmp_path):
    model = fxquant.quantize_(decoder("mixtral", num_hidden_layers=1), {"recipe": "nvfp4_wo"})
    fxquant.save_quantized(model, tmp_path)
    key = "model.layers.0.block_sparse_moe.experts.2.w3.weight_global_scale"
    rewrite(tmp_path, lambda tensors: tensors.__setitem__(key, tensors[key] * 2))
    with pytest.raises(ValueError, match=r"experts\.2\.w1 and .*experts\.2\.w3 have different weight_global_scale"):
        fxquant.load_quantized(skeleton(model), tmp_path)


def test_a_checkpoint_missing_an_experts_tensors_is_refused_by_name(tmp_path):
    model = fxquant.quantize_(decoder("mixtral", num_hidden_layers=1), {"recipe": "int4_wo"})
    fxquant.save_quantized(model, tmp_path)
    gone = "model.layers.0.block_sparse_moe.experts.3.w2."
    rewrite(tmp_path, lambda tensors: [tensors.pop(k) for k in list(tensors) if k.startswith(gone)])
    with pytest.raises(ValueError, match=r"no tensors for \['model\.layers\.0\.block_sparse_moe\.experts\.3\.w2'\]"):
        fxquant.load_quantized(skeleton(model), tmp_path)


DOWN = "model.layers.0.mlp.down_proj."
CORRUPTIONS = {
    "a missing scale": (lambda t: t.pop(DOWN + "weight_scale"),
                        r"holds no model\.layers\.0\.mlp\.down_proj\.weight_scale, which its int4_wo layer"),
    "codes of another shape": (lambda t: t.__setitem__(DOWN + "weight_packed", t[DOWN + "weight_packed"][:-8].clone()),
                               r"down_proj's weight from the checkpoint is \(248, 256\).*holds \(256, 256\)"),
    "an embedding of another vocabulary": (
        lambda t: t.__setitem__("model.embed_tokens.weight", t["model.embed_tokens.weight"][:-1].clone()),
        r"model\.embed_tokens\.weight is \(511, 256\), the model's is \(512, 256\)"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_checkpoint_that_does_not_fit_the_skeleton_is_refused_by_name(tmp_path, corruption):
    """These loaded silently: a layer with fewer rows than the model's, an embedding of another vocabulary."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int4_wo"})
    fxquant.save_quantized(model, tmp_path)
    change, message = CORRUPTIONS[corruption]
    rewrite(tmp_path, change)
    with pytest.raises(ValueError, match=message):
        fxquant.load_quantized(skeleton(model), tmp_path)


def test_a_truncated_checkpoint_is_refused_naming_the_file(tmp_path):
    model = fxquant.quantize_(decoder("llama"), {"recipe": "fp8_row"})
    fxquant.save_quantized(model, tmp_path)
    file = tmp_path / "model.safetensors"
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a whole safetensors file.*download or save it"):
        fxquant.load_quantized(skeleton(model), tmp_path)


def test_a_high_precision_tensor_stored_in_another_float_dtype_takes_the_models(tmp_path):
    """As transformers' loaders do: an fp32 norm weight loads into a bf16 skeleton as bf16, its values rounded."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "fp8_row"})
    fxquant.save_quantized(model, tmp_path)
    rewrite(tmp_path, lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].float()))
    loaded = fxquant.load_quantized(skeleton(model), tmp_path)
    assert loaded.model.norm.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.model.norm.weight, model.model.norm.weight)


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_neox", "mixtral"])
def test_a_skeleton_built_under_empty_weights_loads_with_its_non_persistent_buffers(tmp_path, arch):
    """Under torch.device("meta") the buffers no checkpoint holds (rotary frequencies, Gemma2's embed_scale) stay on
    meta and loading refuses them; under empty_weights() only the parameters are on meta, so a skeleton needs no
    model-specific repair."""
    model = fxquant.quantize_(decoder(arch), {"recipe": "int4_wo"})
    fxquant.save_quantized(model, tmp_path)
    with fxquant.empty_weights():
        empty = type(model)(model.config).to(torch.bfloat16)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert all(b.device.type == "cpu" for b in empty.buffers())
    assert torch.nn.Linear(4, 4).weight.device.type == "cpu"  # the patch ends with the block
    loaded = fxquant.load_quantized(empty, tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT, use_cache=False).logits, model(PROMPT, use_cache=False).logits)


def test_a_skeleton_built_in_another_dtype_loads_in_the_checkpoints_as_from_pretrained_does(tmp_path):
    """The README's skeleton is built in the default fp32: the bf16 checkpoint upcast it to fp32 (twice the
    high-precision bytes, other tokens). dtype="auto" takes config.json's dtype; a dtype given casts to it."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "fp8_block"})
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # fp32 frequencies, as from_pretrained
    fxquant.save_quantized(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with fxquant.empty_weights():
        empty = type(model)(model.config)  # fp32 parameters
    loaded = fxquant.load_quantized(empty, tmp_path)
    assert {p.dtype for n, p in loaded.named_parameters() if "norm" in n or "embed" in n} == {torch.bfloat16}
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT, use_cache=False).logits, model(PROMPT, use_cache=False).logits)
    with fxquant.empty_weights():
        empty = type(model)(model.config)
    wide = fxquant.load_quantized(empty, tmp_path, dtype=torch.float32)
    assert wide.model.norm.weight.dtype == torch.float32
    with pytest.raises(TypeError, match="dtype must be 'auto' or a floating torch.dtype"):
        fxquant.load_quantized(skeleton(model), tmp_path, dtype="bf16")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_checkpoint_folder_alone_loads_into_the_class_its_config_names(tmp_path, arch):
    """load_quantized(path) builds the class config.json names under empty_weights, in eval mode: the logits of the
    skeleton it was given before, bit for bit. save_quantized records that class as save_pretrained does (vLLM picks
    the model by it too); a model built from its config, not loaded, had none recorded."""
    from test_real_models import gpt2

    model = fxquant.quantize_(gpt2() if arch == "gpt2" else decoder("llama"), {"recipe": "int4_wo"})
    if arch == "llama":
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config)  # fp32 frequencies, as a loader builds
    assert not model.config.architectures
    fxquant.save_quantized(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [type(model).__name__]
    loaded = fxquant.load_quantized(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    assert isinstance(loaded.get_submodule(next(n for n, m in model.named_modules()
                                                if isinstance(m, fxquant.QuantizedLinear))), fxquant.QuantizedLinear)
    with fxquant.empty_weights():
        empty = type(model)(transformers.AutoConfig.from_pretrained(tmp_path))
    given = fxquant.load_quantized(empty, tmp_path).eval()
    with torch.no_grad():
        ours = loaded(PROMPT, use_cache=False).logits
        assert torch.equal(ours, given(PROMPT, use_cache=False).logits)
        assert torch.equal(ours, model(PROMPT, use_cache=False).logits)


def test_a_folder_alone_whose_class_transformers_lacks_is_refused_with_the_fix(tmp_path):
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    fxquant.save_quantized(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSomethingElse"]}))
    with pytest.raises(ValueError, match=r"names the architectures \['LlamaForSomethingElse'\].*Fix: build the "
                                         r"skeleton under fxquant\.empty_weights\(\) and pass it"):
        fxquant.load_quantized(tmp_path)
    with pytest.raises(TypeError, match=r"a skeleton and a folder, or a folder alone.*Fix"):
        fxquant.load_quantized(tmp_path, tmp_path)


@pytest.mark.parametrize("damage, error, message", [
    ("no folder", FileNotFoundError, r"no checkpoint folder .*Fix: pass the folder save_quantized"),
    ("no config", FileNotFoundError, r"holds no config\.json"),
    ("corrupt config", ValueError, r"config\.json is not valid JSON .*download or save it again"),
    ("no weights", FileNotFoundError, r"holds neither model\.safetensors nor model\.safetensors\.index\.json"),
])
def test_a_checkpoint_folder_missing_a_file_is_refused_naming_it(tmp_path, damage, error, message):
    """A missing folder raised a raw FileNotFoundError on config.json, a corrupt config.json a JSONDecodeError naming
    no file, and a missing model.safetensors was called truncated."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "fp8_row"})
    fxquant.save_quantized(model, tmp_path / "ckpt")
    folder = tmp_path / ("elsewhere" if damage == "no folder" else "ckpt")
    if damage == "no config":
        (folder / "config.json").unlink()
    elif damage == "corrupt config":
        (folder / "config.json").write_text("{\"quantization_config\": ")
    elif damage == "no weights":
        (folder / "model.safetensors").unlink()
    with pytest.raises(error, match=message):
        fxquant.load_quantized(skeleton(model), folder)


def test_saving_a_model_with_nothing_quantized_is_refused_with_the_fix(tmp_path):
    """It wrote format "mixed-precision" with no config groups, and said nothing."""
    with pytest.raises(ValueError, match=r"holds no layer quantize_ quantized.*Fix: fxquant\.quantize_"):
        fxquant.save_quantized(decoder("llama"), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_symmetric_int4_checkpoint_loads_in_plain_transformers(tmp_path):
    """int4_sym_wo writes GPTQ's layout (no zero points), which transformers' compressed-tensors integration loads
    (int4_wo's zero points are refused there, as compressed-tensors' own asymmetric checkpoints are); in fp32 its
    logits are fxquant's own, both dequantizing the same codes."""
    model = fxquant.quantize_(decoder("llama", dtype=torch.float32), "int4_sym_wo")
    fxquant.save_quantized(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert not [key for key in f.keys() if key.endswith("zero_point")]  # noqa: SIM118
    written = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert [group["weights"]["symmetric"] for group in written["config_groups"].values()] == [True]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert not any(isinstance(m, fxquant.QuantizedLinear) for m in loaded.modules())
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, model(PROMPT).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "int4_wo"])
def test_plain_transformers_loads_what_fxquant_wrote(tmp_path, recipe):
    """As the README says: transformers' compressed-tensors integration loads every recipe's checkpoint but int4_wo's.
    In a bf16 model its logits stay near fxquant's (cosine 0.9988 or more, measured 2026-12-03: its dequantized
    weights and activations round to bf16 where fxquant's GEMMs keep fp32); a misread layout would give about 0."""
    model = fxquant.quantize_(decoder("llama"), recipe)
    fxquant.save_quantized(model, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        got, want = loaded(PROMPT).logits.float(), model(PROMPT).logits.float()
    assert torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.995

