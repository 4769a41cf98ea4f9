"""fxquant.inspect and recipe="auto": per-layer SQNRs that match what runs, and per-layer recipe choice."""

import math

import pytest
import torch
import torch.nn.functional as F
from models import rel_err, tiny_block

import fxquant
from fxquant.config import AUTO_LADDER, QuantConfig
from fxquant.numerics.metrics import sqnr_db

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)


def by_name(report):
    return {m.fqn: m for m in report.layers}


def test_fp8_row_sqnrs_are_those_of_e4m3_and_lm_head_is_reported_skipped():
    layers = by_name(fxquant.inspect(tiny_block(), (X,), {"recipe": "fp8_row"}))
    assert set(layers) == {"q", "up", "down", "lm_head"}
    assert layers["lm_head"].recipe is None and "default exclusion" in layers["lm_head"].reason
    for name in ("q", "up", "down"):
        m = layers[name]
        # e4m3 keeps 3 mantissa bits: ~31 dB per operand, ~29 dB for their product.
        assert m.recipe == "fp8_row" and 30 < m.weight_sqnr < 34 and 30 < m.act_sqnr < 34 and 26 < m.out_sqnr < 32


def test_weight_only_has_no_activation_sqnr_and_int8_beats_int4():
    int8 = by_name(fxquant.inspect(tiny_block(), (X,), {"recipe": "int8_wo"}))["up"]
    int4 = by_name(fxquant.inspect(tiny_block(), (X,), {"recipe": "int4_wo"}))["up"]
    assert int8.act_sqnr is None and int4.act_sqnr is None
    assert int8.out_sqnr > int4.out_sqnr + 15  # 4 more bits: ~24 dB more, less the bf16 output rounding


def test_output_sqnr_is_the_compiled_layers_error():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128)).to(torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    measured = fxquant.inspect(model, (x,), {"recipe": "fp8_block"}).layers[0]
    torch._dynamo.reset()
    out = torch.compile(model, backend="fxquant", options={"recipe": "fp8_block", "inner": "eager"})(x)
    shadow = F.linear(x.float(), model[0].weight.float(), model[0].bias.float())
    assert measured.fqn == "0" and measured.out_sqnr == pytest.approx(sqnr_db(out, shadow), abs=1e-9)


def test_auto_takes_the_cheapest_recipe_over_the_floor():
    low = fxquant.inspect(tiny_block(), (X,), {"recipe": "auto", "min_sqnr_db": 10})
    assert {m.recipe for m in low.layers if m.fqn != "lm_head"} == {AUTO_LADDER[0]}
    mid = by_name(fxquant.inspect(tiny_block(), (X,), {"recipe": "auto", "min_sqnr_db": 35}))
    assert {mid[n].recipe for n in ("q", "up", "down")} == {"int8_wo"}  # fp8 reaches ~29 dB, 4-bit ~19 dB
    assert all(mid[n].out_sqnr >= 35 for n in ("q", "up", "down"))


def test_auto_keeps_a_layer_no_recipe_serves_and_says_why():
    report = fxquant.inspect(tiny_block(), (X,), {"recipe": "auto", "min_sqnr_db": 80})
    up = by_name(report)["up"]
    assert up.recipe is None and "no recipe reaches 80 dB (best int8_wo" in up.reason
    assert report.config.recipe_for("up") == "none"


def test_auto_in_the_backend_reports_the_missed_floor_not_layer_recipes(capsys):
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(tiny_block(), backend="fxquant",
                      options={"recipe": "auto", "min_sqnr_db": 80, "inner": "eager", "report": True})(X)
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("up "))
    assert "auto: no recipe reaches 80 dB (best int8_wo at" in lines[row + 1] and "layer_recipes" not in lines[row + 1]


def test_auto_in_the_backend_matches_the_inspected_config():
    model = tiny_block()
    report = fxquant.inspect(model, (X,), {"recipe": "auto", "min_sqnr_db": 25})
    torch._dynamo.reset()
    auto = torch.compile(model, backend="fxquant", options={"recipe": "auto", "min_sqnr_db": 25, "inner": "eager"})
    with torch.no_grad():
        out = auto(X)
        torch._dynamo.reset()
        pinned = torch.compile(model, backend="fxquant", options={**_as_options(report.config), "inner": "eager"})(X)
    assert torch.equal(out, pinned) and rel_err(out, model(X)) < 0.03


def _as_options(config: QuantConfig) -> dict:
    return {"recipe": config.recipe, "layer_recipes": dict(config.layer_recipes), "min_sqnr_db": config.min_sqnr_db}


def test_report_table_prints_every_layer(capsys):
    fxquant.inspect(tiny_block(), (X,), {"recipe": "int4_wo"}, verbose=True)
    out = capsys.readouterr().out
    assert "fxquant inspect" in out and all(name in out for name in ("q", "up", "down", "lm_head"))


def test_export_with_auto_pins_layers_on_the_sample_inputs():
    model = tiny_block()
    program = fxquant.export(model, (X,), config={"recipe": "auto", "min_sqnr_db": 35})
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("fxquant.linear_weight_only.default") == 3  # int8_wo for q, up, down
    assert rel_err(program.module()(X), model(X)) < 0.01


def test_sqnr_db_edge_cases():
    # integers below 2**16 times 1 + 2**-7 are exact in fp32: the noise is x / 128, the SQNR 20 log10(128) dB
    x = torch.randint(1, 1000, (64,), generator=torch.Generator().manual_seed(0)).float()
    assert math.isinf(sqnr_db(x, x)) and math.isnan(sqnr_db(x * math.inf, x))
    assert sqnr_db(x * (1 + 2**-7), x) == pytest.approx(20 * math.log10(128), abs=1e-9)


def test_bad_layer_recipes_and_unmeasured_auto_are_clear_errors():
    with pytest.raises(ValueError, match="unknown recipe 'fp7'"):
        fxquant.from_options({"layer_recipes": {"up": "fp7"}})
    with pytest.raises(ValueError, match="recipe='auto' needs sample inputs"):
        QuantConfig(recipe="auto").recipe_for("up")
    assert QuantConfig(layer_recipes=((r"^up$", "int4_wo"),)).recipe_for("up") == "int4_wo"


def test_inspect_after_compiles_of_the_same_model_at_other_shapes():
    """Earlier compiles of a Llama at two prompt lengths make dynamo's next capture of its forward dynamic
    (automatic dynamic shapes); measuring that graph failed with "SymIntArrayRef expected to contain only concrete
    integers" at its attention's view."""
    from hf_models import VOCAB, decoder

    model = decoder("llama")
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        for length in (6, 7):
            compiled(torch.randint(0, VOCAB, (1, length)))
    layers = by_name(fxquant.inspect(model, (torch.randint(0, VOCAB, (1, 8)),), {"recipe": "fp8_row"}))
    assert layers["model.layers.0.mlp.up_proj"].out_sqnr is not None
