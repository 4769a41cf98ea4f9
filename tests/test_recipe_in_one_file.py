"""A recipe of an existing kind is one entry in config.RECIPES: quantize_, the compressed-tensors checkpoint (its
scheme read from the recipe), loading and the backend all follow from it."""

import copy
import json

import torch
from hf_models import VOCAB, compiled, decoder, fake_quantized, skeleton, static_decode, traced, within_bound

import fxquant
from fxquant.config import RECIPES, LinearScheme

PROMPT = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
STEPS = torch.randint(0, VOCAB, (1, 3), generator=torch.Generator().manual_seed(5))


def test_an_int4_recipe_in_groups_of_64_added_to_recipes_alone_runs_everywhere(tmp_path, monkeypatch):
    monkeypatch.setitem(RECIPES, "int4_g64_wo", LinearScheme("weight_only", "int4", ("group", 64), k_multiple=64))
    model = decoder("llama")
    quantized = fxquant.quantize_(copy.deepcopy(model), "int4_g64_wo")
    down = quantized.model.layers[0].mlp.down_proj
    assert down.recipe == "int4_g64_wo" and down.weight_scale.shape == (down.out_features, down.in_features // 64)

    fxquant.save_quantized(quantized, tmp_path)
    group = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"] | {"group_size": None} == {"num_bits": 4, "type": "int", "symmetric": False,
                                                       "strategy": "group", "group_size": None, "dynamic": False}
    assert group["weights"]["group_size"] == 64 and group["input_activations"] is None
    loaded = fxquant.load_quantized(skeleton(model), tmp_path)
    assert loaded.model.layers[0].mlp.down_proj.recipe == "int4_g64_wo"
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, quantized(PROMPT).logits, rtol=0, atol=0)

    got = static_decode(model, compiled(model, recipe="int4_g64_wo"), PROMPT, STEPS)
    copies = fake_quantized(model, "int4_g64_wo", exact=True), fake_quantized(model, "int4_g64_wo", exact=False), model
    assert not within_bound(got, *(static_decode(m, traced(m), PROMPT, STEPS) for m in copies))
