"""`python -m fxquant`: quantize a transformers checkpoint folder into a compressed-tensors one (a dense model one
safetensors file at a time), inspect a checkpoint, and the progress bars over layers."""
import json
import subprocess
import sys

import pytest
import torch
from hf_models import decoder, skeleton
from safetensors import safe_open
from test_real_models import PROMPT

import fxquant
from fxquant.__main__ import main


def stored(folder) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else [
        "model.safetensors"]
    tensors = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return tensors


def test_quantize_streams_a_sharded_checkpoint_into_the_one_quantize_and_save_write(tmp_path, capsys):
    """A dense model is read one file at a time (12 files here), and what is written is, tensor for tensor, what
    quantize_ and save_quantized write for the same model."""
    model = decoder("llama")
    model.save_pretrained(tmp_path / "source", max_shard_size="300KB")
    assert len(list((tmp_path / "source").glob("*.safetensors"))) > 4
    assert main(["quantize", str(tmp_path / "source"), str(tmp_path / "cli"), "--recipe", "int4_sym_wo",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "quantized under int4_sym_wo (streamed)" in out
    assert f"fxquant.load_quantized({str(tmp_path / 'cli')!r}, device='cuda') loads it" in out
    fxquant.save_quantized(fxquant.quantize_(model, "int4_sym_wo"), tmp_path / "api")
    cli, api = stored(tmp_path / "cli"), stored(tmp_path / "api")
    assert cli.keys() == api.keys() and all(torch.equal(cli[k], api[k]) for k in api)
    config = lambda kind: json.loads((tmp_path / kind / "config.json").read_text())["quantization_config"]
    assert config("cli") == config("api")
    loaded = fxquant.load_quantized(skeleton(model), tmp_path / "cli")
    with torch.no_grad():
        assert torch.equal(loaded(PROMPT).logits, model(PROMPT).logits)


def test_layer_recipes_from_the_command_line_quantize_the_lm_head_and_pin_layers(tmp_path):
    """--layer-recipe REGEX=RECIPE is quantize_'s layer_recipes: naming lm_head quantizes it, a pinned layer takes its
    own recipe, `none` keeps one; what is written equals quantize_ and save_quantized under the same options."""
    model = decoder("llama")
    model.save_pretrained(tmp_path / "source", max_shard_size="300KB")
    pins = {"lm_head": "int8_wo", r"layers\.0\.mlp\.down_proj": "fp8_row", r"layers\.1\.mlp\.down_proj": "none"}
    main(["quantize", str(tmp_path / "source"), str(tmp_path / "cli"), "--recipe", "int4_sym_wo", "--no-progress",
          "--layer-recipe", *(f"{regex}={recipe}" for regex, recipe in pins.items())])
    fxquant.save_quantized(fxquant.quantize_(model, {"recipe": "int4_sym_wo", "layer_recipes": pins}),
                           tmp_path / "api")
    cli, api = stored(tmp_path / "cli"), stored(tmp_path / "api")
    assert cli.keys() == api.keys() and all(torch.equal(cli[k], api[k]) for k in api)
    written = json.loads((tmp_path / "cli" / "config.json").read_text())["quantization_config"]
    groups = {tuple(group["targets"]): group for group in written["config_groups"].values()}
    assert any("lm_head" in targets for targets in groups) and "model.layers.1.mlp.down_proj" in written["ignore"]
    assert any("model.layers.0.mlp.down_proj" in targets and group["weights"]["type"] == "float"
               for targets, group in groups.items())
    with pytest.raises(SystemExit):
        main(["quantize", str(tmp_path / "source"), str(tmp_path / "bad"), "--layer-recipe", "lm_head=int3"])


def test_quantize_loads_a_moe_checkpoint_whole_and_keeps_its_routers(tmp_path, capsys):
    """transformers converts Mixtral's per-expert tensors as it loads: that model is loaded whole, its routers found
    by structure (kept), its experts quantized."""
    decoder("mixtral").save_pretrained(tmp_path / "source")
    main(["quantize", str(tmp_path / "source"), str(tmp_path / "out"), "--recipe", "int4_wo", "--no-progress"])
    assert "(loaded whole)" in capsys.readouterr().out
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    targets = [name for group in written["config_groups"].values() for name in group["targets"]]
    assert "model.layers.0.mlp.experts.0.w1" in targets or any("experts" in name for name in targets)
    assert not any(name.endswith("mlp.gate") for name in targets)


def test_quantize_refuses_a_quantized_source_and_auto(tmp_path):
    fxquant.save_quantized(fxquant.quantize_(decoder("llama"), "fp8_row"), tmp_path / "fp8")
    with pytest.raises(ValueError, match="already quantized .*round twice"):
        main(["quantize", str(tmp_path / "fp8"), str(tmp_path / "again")])
    from fxquant.io.convert import quantize_checkpoint

    with pytest.raises(ValueError, match="recipe='auto' measures each layer on sample inputs"):
        quantize_checkpoint(tmp_path / "fp8", tmp_path / "auto", "auto")


def test_inspect_lists_layers_formats_and_bytes(tmp_path, capsys):
    model = fxquant.quantize_(decoder("llama"), {"recipe": "fp8_row", "skip": ["down_proj"]})
    fxquant.save_quantized(model, tmp_path)
    main(["inspect", str(tmp_path)])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith(("model.", "lm_"))}
    assert rows["model.layers.0.self_attn.q_proj"] == "fp8_row" and rows["lm_head"] == "high"
    assert rows["model.layers.0.mlp.down_proj"] == "high" and "model.norm" not in rows
    assert "bytes by format: " in out and max(map(len, out.splitlines())) <= 120


def test_help_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "fxquant", "--help"], capture_output=True, text=True, check=True)
    assert "quantize" in out.stdout and "inspect" in out.stdout


@pytest.mark.parametrize("progress, shown", [(True, True), (False, False), (None, False)])
def test_progress_bars_over_layers(tmp_path, capsys, progress, shown):
    """quantize_ and load_quantized show a bar where asked; by default only on a terminal (pytest's is not one)."""
    model = fxquant.quantize_(decoder("llama"), "fp8_row", progress=progress)
    fxquant.save_quantized(model, tmp_path)
    fxquant.load_quantized(skeleton(model), tmp_path, progress=progress)
    err = capsys.readouterr().err
    assert ("fxquant quantize_" in err and "fxquant load_quantized" in err) == shown
