"""The pipeline as a pass manager: each pass is timed and logged, dumps the graph it leaves where asked, and the
passes that only fuse or pack can be left out (options={"disable_passes": [...]}): the compiled model then stays
within the bound of its fake-quantized copy, as with every pass."""

import functools
import logging

import pytest
import torch
from hf_models import VOCAB, compiled_results, decoder, fake_quantized, static_decode, traced, within_bound

from fxquant.compile.pipeline import OPTIONAL, PASSES, run_pipeline
from fxquant.config import QuantConfig, from_options
from fxquant.passes.order import passes_run

X = torch.randn(2, 128, dtype=torch.bfloat16)
MODEL = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Softmax(-1)).to(torch.bfloat16)
GENERATOR = torch.Generator().manual_seed(5)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 3), generator=GENERATOR)


def exported():
    return torch.export.export(MODEL, (X,)).module()


def test_each_pass_is_timed_and_logged_with_what_it_changed(caplog):
    with caplog.at_level(logging.DEBUG, logger="fxquant.compile.pipeline"):
        result = run_pipeline(exported(), QuantConfig(recipe="fp8_row"), (X,))
    assert [timing.name for timing in result.timings] == list(PASSES)
    lines = {record.getMessage().split(":")[0]: record.getMessage() for record in caplog.records
             if record.name == "fxquant.compile.pipeline"}
    assert list(lines) == list(PASSES)
    assert "unchanged" in lines["detect"]  # annotations only
    assert ", changed," in lines["quantize_linear"] and ", changed," in lines["upcast"]
    quantize = result.timings[PASSES.index("quantize_linear")]
    assert quantize.modified and quantize.seconds > 0 and quantize.nodes[1] > quantize.nodes[0]  # + weights, scales


def test_each_pass_dumps_the_graph_it_leaves_where_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("FXQUANT_DUMP_GRAPHS", str(tmp_path))
    run_pipeline(exported(), QuantConfig(recipe="fp8_row"), (X,))
    files = sorted(path.name for path in tmp_path.iterdir())
    run = files[0].split("-")[0]
    dumped = list(enumerate(PASSES))  # numbered by place in PASSES
    assert files == [f"{run}-{place:02d}-{name}.txt" for place, name in dumped]
    text = {name: (tmp_path / f"{run}-{place:02d}-{name}.txt").read_text() for place, name in dumped}
    assert "torch.float32" not in text["detect"] and "torch.float32" in text["upcast"]  # the softmax's fp32 input
    assert "torch.ops.fxquant." not in text["upcast"] and "torch.ops.fxquant." in text["quantize_linear"]


@pytest.mark.parametrize("names, error, match", [
    (["detect"], ValueError, "detect cannot be left out .* the passes it may leave out: fuse_norm, merge_linear"),
    (["fuse_norms"], ValueError, "there is no pass fuse_norms"),
    (3, TypeError, "option 'disable_passes' must be a pass's name or a list of them"),
])
def test_disable_passes_refuses_a_pass_that_must_run_or_none(names, error, match):
    with pytest.raises(error, match=match):
        run_pipeline(exported(), from_options({"disable_passes": names}), (X,))


def _decode(recipe: str, options: dict):
    model = decoder("llama")
    forward, results = compiled_results(model, {"recipe": recipe, "inner": "eager", **options})
    return static_decode(model, forward, PROMPT, STEPS), results


@functools.cache
def reference(recipe: str):
    """Every pass's decode results under the recipe, and its bound (exact, plain fake-quantized copies, eager)."""
    model = decoder("llama")
    copies = [fake_quantized(model, recipe, exact) for exact in (True, False)]
    bound = (*(static_decode(copy, traced(copy), PROMPT, STEPS) for copy in copies),
             static_decode(model, model, PROMPT, STEPS))
    return _decode(recipe, {})[1], bound


@pytest.mark.xdist_group("pass_manager_references")  # one worker computes each recipe's references once
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name == "pack_lanes" else name
                                  for name in OPTIONAL])  # CI: int4's references for a pass with no work on the CPU
def test_a_pass_left_out_does_not_run_and_the_model_stays_within_its_bound(name):
    recipe = "int4_wo" if name == "pack_lanes" else "fp8_row"  # the packing pass has int4 weights only
    every_pass, bound = reference(recipe)
    got, results = _decode(recipe, {"disable_passes": name})
    assert results and all(name not in passes_run(result.gm) for result in results)
    assert all(name not in [timing.name for timing in result.timings] for result in results)
    changed = [timing.modified for result in every_pass for timing in result.timings if timing.name == name]
    if any(changed):  # where the pass has work on this device, its absence shows in the graphs
        assert [str(r.gm.code) for r in results] != [str(r.gm.code) for r in every_pass]
    assert not within_bound(got, *bound)
