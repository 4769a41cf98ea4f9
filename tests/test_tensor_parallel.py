"""Tensor parallelism on the CPU: a model sharded with DTensor (q/k/v, gate/up column parallel; o, down row parallel)
over 2 and 4 gloo processes, compiled under backend="fxquant". Each rank quantizes its own shard and runs fxquant's
ops on local tensors; DTensor keeps the collectives. Bound: independent fake-quantized copies of the unsharded model
that quantize a row-parallel layer's weight and input per slice of K, as the ranks do (per-token activation scales
over a K-sharded input are per shard)."""

import pytest
import torch
from hf_models import VOCAB, compiled_results, decoder, fake_quantized, static_decode, traced, within_bound
from reports import layer_rows
from tensor_parallel import ROW, run, sharded_decode, sharded_load, sharded_quantize_, sharded_save

GENERATOR = torch.Generator().manual_seed(11)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 3), generator=GENERATOR)
RECIPES = ["fp8_row", "fp8_block", "int4_wo"]
WIDE_KV = dict(num_key_value_heads=4)  # k/v of 256 rows: shards of 128 rows at 2 ranks, which fp8_block's blocks tile
# The tests of one module fixture run on one xdist worker (pyproject's --dist loadgroup): each fixture starts its
# ranks and compiles for 40-70 s, and a worker that ran one of its tests built the fixture anew.
ON_TWO_RANKS = pytest.mark.xdist_group("tensor_parallel_two_ranks")
ON_LOADED = pytest.mark.xdist_group("tensor_parallel_loaded")


@pytest.fixture(scope="module")
def two_ranks():
    return run(2, sharded_decode, arch="llama", recipes=[None, *RECIPES], prompt=PROMPT, steps=STEPS, **WIDE_KV)


@pytest.fixture(scope="module")
def four_ranks():
    return run(4, sharded_decode, arch="llama", recipes=["fp8_row", "fp8_block"], prompt=PROMPT, steps=STEPS,
               **WIDE_KV)


def bound(model, recipe: str, world: int, row=ROW):
    """(exact, plain, eager) static-cache logits: the fake-quantized copies with per-shard K slices, and eager."""
    shards = {name: world for name in row}
    copies = [fake_quantized(model, recipe, exact, k_shards=shards) for exact in (True, False)]
    return (*(static_decode(m, traced(m), PROMPT, STEPS) for m in copies), static_decode(model, model, PROMPT, STEPS))


def unsharded_records(model, recipe: str) -> dict:
    """The unsharded model's layer records under the recipe: name -> (recipe, reason, bytes before, after)."""
    forward, results = compiled_results(model, {"recipe": recipe, "inner": "eager"})
    static_decode(model, forward, PROMPT, STEPS)
    return {r.fqn: (r.recipe, r.reason, r.bytes_before, r.bytes_after) for result in results for r in result.layers}


@ON_TWO_RANKS
def test_with_nothing_quantized_the_sharded_decode_equals_its_eager_run(two_ranks):
    """The rewrite to local shards keeps every cache write and computes what DTensor computes, as dynamo runs it."""
    for result in two_ranks:
        torch.testing.assert_close(result[None][0], result["traced"], rtol=0, atol=0)


@ON_TWO_RANKS
@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_decode_within_the_per_shard_fake_quantized_bound(two_ranks, recipe):
    model = decoder("llama", **WIDE_KV)
    exact, plain, eager = bound(model, recipe, 2)
    for rank, result in enumerate(two_ranks):
        assert not within_bound(result[recipe][0], exact, plain, eager), rank
    assert torch.equal(two_ranks[0][recipe][0], two_ranks[1][recipe][0])  # the logits are replicated
    torch.testing.assert_close(two_ranks[0]["eager"], eager, rtol=0, atol=2e-2)  # sharded eager: bf16 sums apart


@ON_TWO_RANKS
@pytest.mark.parametrize("recipe", RECIPES)
def test_each_rank_holds_its_share_of_the_quantized_bytes(two_ranks, recipe):
    """Every sharded layer is quantized on every rank, with half its bytes: exactly half of the codes, plus, for a
    row-parallel layer under per-channel scales, the scales each rank keeps whole (1.5% here, at K = 256)."""
    whole = unsharded_records(decoder("llama", **WIDE_KV), recipe)
    sharded = [name for name in whole if name.endswith(ROW) or ".self_attn." in name or ".mlp." in name]
    assert len(sharded) == 14
    for result in two_ranks:
        layers = result[recipe][1]
        for name in sharded:
            kept_recipe, reason, before, after = layers[name]
            assert kept_recipe == recipe, (name, reason)
            assert 2 * before == whole[name][2]
            assert whole[name][3] <= 2 * after <= 1.02 * whole[name][3], name


@pytest.mark.cpu_matrix  # four ranks on CI's two cores
def test_four_ranks_decode_within_the_bound_and_a_block_split_by_the_shard_is_refused_by_name(four_ranks):
    """At 4 ranks, q/k/v's shards are 64 rows and o_proj's 64 columns: fp8_block's 128x128 blocks do not tile them,
    and those layers stay in high precision with the reason and the fix; gate/up (128 rows) and down (128 columns)
    are quantized. fp8_row quantizes every shard."""
    model = decoder("llama", **WIDE_KV)
    exact, plain, eager = bound(model, "fp8_row", 4)
    assert not within_bound(four_ranks[0]["fp8_row"][0], exact, plain, eager)
    for result in four_ranks:
        layers = result["fp8_block"][1]
        for layer in range(model.config.num_hidden_layers):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                recipe, reason, _, _ = layers[f"model.layers.{layer}.self_attn.{name}"]
                assert recipe is None and "alignment" in reason and "tensor-parallel weight" in reason
            for name in ("gate_proj", "up_proj", "down_proj"):
                assert layers[f"model.layers.{layer}.mlp.{name}"][0] == "fp8_block"


@pytest.fixture(scope="module", params=[pytest.param(recipe, marks=pytest.mark.cpu_matrix)  # ranks, experts: CI skips
                                        for recipe in ("fp8_row", "int4_wo")])
def mixtral(request):
    """(recipe, each rank's sharded_decode result) for Mixtral with its attention sharded and its experts whole."""
    return request.param, run(2, sharded_decode, arch="mixtral", recipes=[request.param], prompt=PROMPT, steps=STEPS,
                              experts=True, **WIDE_KV)


def test_mixtral_with_sharded_attention_and_whole_experts(mixtral):
    """Attention sharded, the experts whole on each rank: both quantized, the experts by the grouped GEMMs, and the
    decode within the bound on every rank."""
    recipe, ranks = mixtral
    model = decoder("mixtral", **WIDE_KV)
    exact, plain, eager = bound(model, recipe, 2, row=("self_attn.o_proj",))
    for result in ranks:
        assert not within_bound(result[recipe][0], exact, plain, eager)
    layers = ranks[0][recipe][1]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert layers[f"model.layers.0.self_attn.{name}"][0] == recipe, name
    assert any("experts" in name and record[0] == recipe for name, record in layers.items())


@pytest.mark.cpu_matrix  # each rank quantizes and compiles: 70 s of CI's two cores
@pytest.mark.parametrize("recipe", ["fp8_row", "int4_wo"])
def test_quantize_shards_each_rank_s_weights_and_decodes_within_the_bound(recipe):
    """quantize_ on the sharded model: every sharded linear becomes a QuantizedLinear whose codes and scales are
    DTensors sharded as its weight was (column parallel Shard(0), row parallel Shard(1)), each rank holding its own
    quantized shard. Its decode, eager and compiled, is within the per-shard fake-quantized bound."""
    from torch.distributed.tensor import Shard

    model = decoder("llama", **WIDE_KV)
    whole = unsharded_records(model, recipe)
    exact, plain, eager = bound(model, recipe, 2)
    ranks = run(2, sharded_quantize_, arch="llama", recipe=recipe, prompt=PROMPT, steps=STEPS, **WIDE_KV)
    for result in ranks:
        assert set(result["classes"].values()) == {"QuantizedLinear"} and len(result["classes"]) == 14
        for name, parts in result["parts"].items():
            placement = (Shard(1),) if name.endswith(ROW) else (Shard(0),)
            assert parts and all(got == placement for got, _ in parts.values()), (name, parts)
            held = sum(nbytes for _, nbytes in parts.values())
            assert whole[name][3] <= 2 * held <= 1.02 * whole[name][3], name  # half, plus per-shard row scales
        assert "quantized" in result["report"] and "DTensor" not in result["report"]
        for logits in (result["after"], result["compiled"]):
            assert not within_bound(logits, exact, plain, eager)
    torch.testing.assert_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=0)  # replicated


@pytest.mark.cpu_matrix  # its ranks' compiles on CI's two cores
def test_quantize_leaves_a_layer_whose_shard_splits_a_block_and_says_why():
    """At 4 ranks q/k/v's shards are 64 rows: fp8_block's 128-row blocks do not tile them. quantize_ keeps those
    layers, with the alignment reason and the resharding hint, and quantizes gate/up/down (128-row shards)."""
    for result in run(4, sharded_quantize_, arch="llama", recipe="fp8_block", prompt=PROMPT, steps=STEPS,
                      **WIDE_KV):
        classes = result["classes"]
        assert {classes[n] for n in classes if ".self_attn." in n} == {"Linear"}
        assert {classes[n] for n in classes if ".mlp." in n} == {"QuantizedLinear"}
        rows = [row for name, row in layer_rows(result["report"]).items() if ".self_attn." in name]
        assert rows and all("alignment" in row and "tensor-parallel weight" in row for row in rows)


@pytest.mark.parametrize("recipe", ["int4_wo", pytest.param("fp8_block", marks=pytest.mark.cpu_matrix)])  # CI: one
def test_a_sharded_model_saves_the_unsharded_model_s_checkpoint(tmp_path, recipe):
    """save_quantized on every rank of the quantize_'d sharded model writes, from rank 0, the checkpoint the unsharded
    model quantize_'d the same way writes: the same tensors bit for bit and the same quantization_config (int4's
    groups and fp8_block's blocks fall inside the shards)."""
    import json

    from safetensors.torch import load_file

    import fxquant

    assert run(2, sharded_save, arch="llama", recipe=recipe, path=str(tmp_path / "sharded"), **WIDE_KV) == [None] * 2
    model = fxquant.quantize_(decoder("llama", **WIDE_KV), recipe)
    fxquant.save_quantized(model, tmp_path / "whole")
    sharded, whole = (load_file(tmp_path / kind / "model.safetensors") for kind in ("sharded", "whole"))
    assert sharded.keys() == whole.keys()
    for key in whole:
        assert torch.equal(sharded[key], whole[key]), key
    config = lambda kind: json.loads((tmp_path / kind / "config.json").read_text())["quantization_config"]
    assert config("sharded") == config("whole")


def test_saving_a_row_parallel_per_channel_scale_is_refused_by_name(tmp_path):
    """fp8_row's row-parallel shards each keep their own per-channel scale: no checkpoint's per-row scale holds
    them, so save_quantized says which layer and the fix, on every rank, and writes nothing."""
    errors = run(2, sharded_save, arch="llama", recipe="fp8_row", path=str(tmp_path / "sharded"), **WIDE_KV)
    for error in errors:
        assert "model.layers.0.self_attn.o_proj is row parallel under fp8_row" in error and "Fix:" in error
    assert not (tmp_path / "sharded").exists()



LOADED = {"fp8_row": ("llama", "fp8_row"), "fp8_block": ("llama", "fp8_block"), "int4_wo": ("llama", "int4_wo"),
          "qwen2 int4_wo": ("qwen2", "int4_wo")}  # Qwen2: column-parallel q/k/v with biases


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The unsharded quantize_'d models, their checkpoints, and what each of 2 ranks loads from them into a sharded
    skeleton."""
    import fxquant

    folder = tmp_path_factory.mktemp("checkpoints")
    models = {label: fxquant.quantize_(decoder(arch, **WIDE_KV), recipe) for label, (arch, recipe) in LOADED.items()}
    for label, model in models.items():
        fxquant.save_quantized(model, folder / label)
    checkpoints = {label: (arch, str(folder / label)) for label, (arch, _) in LOADED.items()}
    ranks = run(2, sharded_load, checkpoints=checkpoints, prompt=PROMPT, steps=STEPS, **WIDE_KV)
    return folder, models, ranks


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@ON_LOADED
@pytest.mark.parametrize("label", LOADED)
def test_a_sharded_skeleton_loads_each_rank_s_slice_of_the_checkpoint(loaded, label):
    """load_quantized into a skeleton sharded before loading: each rank's codes, scales and bias are bit for bit its
    slice of the unsharded model's (Shard(0) rows for column parallel, Shard(1) columns for row parallel, where a
    row-parallel per-channel scale is the whole row's on each rank), and no sharded tensor of the checkpoint is
    read whole but those scales and `weight_shape`."""
    from torch.distributed.tensor import Shard

    _, models, ranks = loaded
    model, recipe = models[label], LOADED[label][1]
    for rank, result in enumerate(ranks):
        got = result[label]
        assert len(got["parts"]) == 14
        for name, parts in got["parts"].items():
            layer, dim = model.get_submodule(name), 1 if name.endswith(ROW) else 0
            held = {p for p in [*layer.part_names(), "bias"] if getattr(layer, p) is not None}
            assert set(parts) == held, name
            for part, (placements, local) in parts.items():
                assert placements == (Shard(dim),), (name, part)
                whole = getattr(layer, part).detach()
                expected = whole if whole.shape[dim] == 1 else whole.chunk(2, dim)[rank]
                assert local.dtype == whole.dtype and torch.equal(_bytes(local), _bytes(expected)), (name, part)
        for key in got["read_whole"]:
            name, _, stored = key.rpartition(".")
            if name in got["parts"]:
                assert stored == "weight_shape" or (recipe == "fp8_row" and name.endswith(ROW)
                                                    and stored == "weight_scale"), key


@ON_LOADED
@pytest.mark.parametrize("label", ["fp8_block", "int4_wo", "qwen2 int4_wo"])
def test_a_loaded_sharded_model_decodes_within_the_bound(loaded, label):
    """Where the checkpoint's groups and blocks fall inside the shards, the loaded sharded model computes the
    unsharded quantized model: its decode is within the fake-quantized bound, and replicated."""
    _, _, ranks = loaded
    arch, recipe = LOADED[label]
    exact, plain, eager = bound(decoder(arch, **WIDE_KV), recipe, 2)
    for result in ranks:
        assert not within_bound(result[label]["eager"], exact, plain, eager)
    assert torch.equal(ranks[0][label]["eager"], ranks[1][label]["eager"])


@ON_LOADED
@pytest.mark.parametrize("label", LOADED)
def test_a_loaded_sharded_model_saves_the_checkpoint_it_loaded(loaded, label):
    """save_quantized from the loaded sharded model writes the checkpoint it was loaded from, bit for bit: fp8_row's
    row-parallel shards share each row's scale, so they gather into the checkpoint's one scale per row."""
    from safetensors.torch import load_file

    folder, _, _ = loaded
    resaved, original = (load_file(folder / name / "model.safetensors") for name in (f"{label}-resaved", label))
    assert resaved.keys() == original.keys()
    for key in original:
        assert torch.equal(_bytes(resaved[key]), _bytes(original[key])), key


@pytest.mark.cpu_matrix  # 30 s of CI's two cores (ranks loading two checkpoints)
def test_a_shard_that_splits_the_checkpoint_s_blocks_or_its_scale_is_refused_by_name(tmp_path):
    """With 2 KV heads of 64, k_proj and v_proj have 128 rows: shards of 64 rows at 2 ranks split fp8_block's
    128x128 blocks. fp8_tensor's one weight scale per tensor would differ per shard. Loading either refuses,
    naming the layer and the fix, on every rank."""
    import fxquant

    for recipe in ("fp8_block", "fp8_tensor"):
        fxquant.save_quantized(fxquant.quantize_(decoder("llama"), recipe), tmp_path / recipe)
    checkpoints = {recipe: ("llama", str(tmp_path / recipe)) for recipe in ("fp8_block", "fp8_tensor")}
    for result in run(2, sharded_load, checkpoints=checkpoints, prompt=PROMPT, steps=STEPS):
        error = result["fp8_block"]
        assert "model.layers.0.self_attn.k_proj's shard on each of 2 ranks is [64, 256]" in error
        assert "Fix: shard over fewer ranks" in error
        error = result["fp8_tensor"]
        assert "model.layers.0.self_attn.q_proj is fp8_tensor, (Shard(dim=0),) on a 1-D mesh" in error
        assert "not fp8_tensor or nvfp4_wo" in error and "Fix: shard model.layers.0.self_attn.q_proj" in error
