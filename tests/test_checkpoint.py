"""compressed-tensors checkpoints, checked against the compressed-tensors package itself (test extra only): what its
compressors write loads into fxquant with bit-identical dequantized weights, and what fxquant writes decompresses
in compressed-tensors to fxquant's values. NVFP4's global scale is divided by there and multiplied by here (its
rounded reciprocal), which may round an element apart; on these models no element does."""

import json

import pytest
import torch
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
from fxquant import reference as R
from fxquant.config import RECIPES
from fxquant.granularity import as_granularity
from fxquant.quantized import Quantized

INT8_CHANNEL = dict(weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True))
# compressed-tensors scheme -> (its format, the recipe fxquant computes it with)
CT_SCHEMES = {
    "FP8_DYNAMIC": (PRESET_SCHEMES["FP8_DYNAMIC"], "float-quantized", "fp8_row"),
    "FP8_BLOCK": (PRESET_SCHEMES["FP8_BLOCK"], "float-quantized", "fp8_block"),
    "W4A16_ASYM": (PRESET_SCHEMES["W4A16_ASYM"], "pack-quantized", "int4_wo"),
    "W4A16": (PRESET_SCHEMES["W4A16"], "pack-quantized", "int4_wo"),
    "W8A16_CHANNEL": (INT8_CHANNEL, "pack-quantized", "int8_wo"),
    "MXFP4A16": (PRESET_SCHEMES["MXFP4A16"], "mxfp4-pack-quantized", "mxfp4_wo"),
    "NVFP4A16": (PRESET_SCHEMES["NVFP4A16"], "nvfp4-pack-quantized", "nvfp4_wo"),
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
    tensors.update({k: v.contiguous() for k, v in state.items()})
    save_file(tensors, path / "model.safetensors")
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"])
    (path / "config.json").write_text(json.dumps(
        {**model.config.to_dict(), "quantization_config": config.model_dump(mode="json", exclude_none=True)},
        default=str))
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


@pytest.mark.parametrize("recipe", ["fp8_row", "fp8_block", "fp8_tensor", "int8_wo", "int4_wo", "mxfp4_wo", "nvfp4_wo"])
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


def test_loading_leaves_nothing_on_meta_silently(tmp_path):
    """A non-persistent buffer (rotary frequencies) is in no checkpoint: loading names it and the fix."""
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    fxquant.save_quantized(model, tmp_path)
    with torch.device("meta"):
        empty = type(model)(model.config)
    with pytest.raises(ValueError, match=r"inv_freq.*still on the meta device.*Fix: build those modules"):
        fxquant.load_quantized(empty, tmp_path)


def test_a_scheme_no_recipe_computes_is_refused_by_name(tmp_path):
    model = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"})
    fxquant.save_quantized(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match="config group group_0: no fxquant recipe computes"):
        fxquant.load_quantized(skeleton(model), tmp_path)
