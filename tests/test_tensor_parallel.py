"""Tensor parallelism on the CPU: a model sharded with DTensor (q/k/v, gate/up column parallel; o, down row parallel)
over 2 and 4 gloo processes, compiled under backend="fxquant". Each rank quantizes its own shard and runs fxquant's
ops on local tensors; DTensor keeps the collectives. Bound: independent fake-quantized copies of the unsharded model
that quantize a row-parallel layer's weight and input per slice of K, as the ranks do (per-token activation scales
over a K-sharded input are per shard)."""

import pytest
import torch
from hf_models import VOCAB, decoder, fake_quantized, static_decode, traced, within_bound
from tensor_parallel import ROW, run, sharded_decode, sharded_quantize_

GENERATOR = torch.Generator().manual_seed(11)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 3), generator=GENERATOR)
RECIPES = ["fp8_row", "fp8_block", "int4_wo"]
WIDE_KV = dict(num_key_value_heads=4)  # k/v of 256 rows: shards of 128 rows at 2 ranks, which fp8_block's blocks tile


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
    from fxquant.backend import fxquant as fxquant_backend

    records = []

    def backend(gm, inputs):
        compiled = fxquant_backend(gm, inputs, options={"recipe": recipe, "inner": "eager"})
        records.extend(compiled.result.layers)
        return compiled

    torch._dynamo.reset()
    static_decode(model, torch.compile(model, backend=backend), PROMPT, STEPS)
    return {r.fqn: (r.recipe, r.reason, r.bytes_before, r.bytes_after) for r in records}


def test_with_nothing_quantized_the_sharded_decode_equals_its_eager_run(two_ranks):
    """The rewrite to local shards keeps every cache write and computes what DTensor computes, as dynamo runs it."""
    for result in two_ranks:
        torch.testing.assert_close(result[None][0], result["traced"], rtol=0, atol=0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_two_ranks_decode_within_the_per_shard_fake_quantized_bound(two_ranks, recipe):
    model = decoder("llama", **WIDE_KV)
    exact, plain, eager = bound(model, recipe, 2)
    for rank, result in enumerate(two_ranks):
        assert not within_bound(result[recipe][0], exact, plain, eager), rank
    assert torch.equal(two_ranks[0][recipe][0], two_ranks[1][recipe][0])  # the logits are replicated
    torch.testing.assert_close(two_ranks[0]["eager"], eager, rtol=0, atol=2e-2)  # sharded eager: bf16 sums apart


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


def test_mixtral_with_sharded_attention_and_whole_experts():
    """Attention sharded, the experts whole on each rank: both quantized, the experts by the grouped GEMMs."""
    ranks = run(2, sharded_decode, arch="mixtral", recipes=["fp8_row"], prompt=PROMPT, steps=STEPS, experts=True)
    model = decoder("mixtral")
    exact, plain, eager = bound(model, "fp8_row", 2, row=("self_attn.o_proj",))
    assert not within_bound(ranks[0]["fp8_row"][0], exact, plain, eager)
    layers = ranks[0]["fp8_row"][1]
    assert layers["model.layers.0.self_attn.q_proj"][0] == "fp8_row"
    assert any("experts" in name and record[0] == "fp8_row" for name, record in layers.items())


def test_quantize_on_a_sharded_model_keeps_the_sharded_layers_and_says_so():
    """quantize_ does not quantize DTensor weights (the backend does, on local shards): every sharded linear stays an
    nn.Linear, the logits do not move, and the report gives the reason (SHARDED_REASON)."""
    for result in run(2, sharded_quantize_, arch="llama", recipe="fp8_row", prompt=PROMPT):
        assert set(result["classes"].values()) == {"Linear"} and len(result["classes"]) == 14
        torch.testing.assert_close(result["after"], result["before"], rtol=0, atol=0)
        rows = [line for line in result["report"].splitlines() if line.startswith("model.layers.")]
        assert len(rows) == 14 and all("DTensor (tensor-parallel) weight" in row for row in rows)
