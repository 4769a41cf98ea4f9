"""The pipeline: freeze_params -> localize_shards -> detect -> upcast, the numerics lint (and recipe="auto"'s
measurements), then quantize_linear -> fuse_norm -> merge_linear -> fuse_linear -> pack_int4_lanes ->
decode_attention -> pack_gqa -> cleanup. It sits above the passes: they never import the lint or the measurements,
and what they hand each other travels in one `PipelineState`."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxquant.capability import check_config, graph_device, usable_recipes
from fxquant.config import AUTO, QuantConfig
from fxquant.lint import Finding, lint_graph, lint_layers, refuse_errors, warn_findings
from fxquant.passes.cleanup import Cleanup
from fxquant.passes.decode_attention import DecodeAttention
from fxquant.passes.detect import Detect
from fxquant.passes.freeze_params import FreezeParams
from fxquant.passes.fuse_linear import FuseLinear
from fxquant.passes.fuse_norm import FuseNorm
from fxquant.passes.localize_shards import LocalizeShards
from fxquant.passes.merge_linear import MergeLinear
from fxquant.passes.pack_gqa import PackGQA
from fxquant.passes.pack_int4_lanes import PackInt4Lanes
from fxquant.passes.quantize_linear import QuantizeLinear
from fxquant.passes.state import LayerRecord, PipelineState
from fxquant.passes.upcast import Upcast
from fxquant.weights import WeightEntry, weight_inventory


@dataclass
class PipelineResult:
    gm: torch.fx.GraphModule
    layers: list[LayerRecord]
    upcast: list[str]
    config: QuantConfig  # with recipe="auto" resolved to per-layer recipes
    findings: list[Finding]  # the numerics lint's, errors excluded (those refuse the compile)
    weights: list[WeightEntry]  # every parameter the graph reads, for the report's totals
    auto: list = field(default_factory=list)  # recipe="auto"'s measurements (measure.LayerError), for the report

    def warn(self) -> None:
        """One warning per compile listing every warning-level finding."""
        warn_findings(self.findings, stacklevel=3)


def prepare(gm: torch.fx.GraphModule, state: PipelineState, example_inputs=None,
            parameter_names: dict[int, str] | None = None, stop_after: str | None = None) -> torch.fx.GraphModule:
    """freeze_params -> localize_shards -> detect -> upcast: the graph annotated, with its reductions in fp32, not yet
    quantized. parameter_names (id of a parameter -> its name in the model) names layers from the model's root where the
    caller holds the model: dynamo names them from the compiled frame's module, a submodule after a graph break."""
    return _run([FreezeParams(example_inputs, parameter_names), LocalizeShards(), Detect(), Upcast(state)], gm,
                stop_after)


def _run(passes, gm: torch.fx.GraphModule, stop_after: str | None = None) -> torch.fx.GraphModule:
    """Each pass once, in order, up to the one named stop_after. Each recompiles the graph's code where it changed the
    graph; torch's PassManager would recompile after every pass, changed or not: 4.0 of the pipeline's 7.5 s in a
    cProfile of a 32-layer compile (bench/HISTORY.md, "The pipeline's time per compile, linear in the layers
    (CPU)")."""
    for run_pass in passes:
        gm = run_pass(gm).graph_module
        if run_pass.name == stop_after:
            break
    return gm


PREPARE = ("freeze_params", "localize_shards", "detect", "upcast")
PASSES = (*PREPARE, "quantize_linear", "fuse_norm", "merge_linear", "fuse_linear", "pack_int4_lanes",
          "decode_attention", "pack_gqa", "cleanup")


def run_pipeline(gm: torch.fx.GraphModule, config: QuantConfig, example_inputs=None, *,
                 stop_after: str | None = None) -> PipelineResult:
    """The whole pipeline; recipe="auto" measures each unpinned layer on example_inputs (real tensors) first.

    stop_after: the name of a pass (PASSES); the pipeline stops after it and the result holds the graph as that pass
    leaves it, for a test or a look at one pass's work. A run that stops in the preparation (PREPARE) lints the graph
    but quantizes nothing."""
    if stop_after is not None and stop_after not in PASSES:
        raise ValueError(f"fxquant: no pass {stop_after!r}; the pipeline's passes: {', '.join(PASSES)}")
    device = graph_device(gm, example_inputs)
    check_config(config, device)
    state = PipelineState(config)
    gm = prepare(gm, state, example_inputs, stop_after=stop_after)
    weights = weight_inventory(gm)
    findings, auto = lint_graph(gm, example_inputs), []
    if stop_after in PREPARE:
        refuse_errors(findings, "compile")
        return PipelineResult(gm, state.layers, state.upcast, config, findings, weights)
    if config.recipe == AUTO:
        from fxquant.measure import measure_graph, resolve_auto

        if example_inputs is None:
            raise ValueError("fxquant: recipe='auto' needs sample inputs to measure each layer on")
        measured = auto = measure_graph(gm, example_inputs, config, usable_recipes(device))
        state.config = config = resolve_auto(config, measured)
        state.auto_reasons = {m.fqn: m.reason for m in measured if m.chosen_by_auto and m.recipe is None}
    gm = _run([QuantizeLinear(state), FuseNorm(state), MergeLinear(state), FuseLinear(), PackInt4Lanes(state),
               DecodeAttention(state), PackGQA(), Cleanup()], gm, stop_after)
    findings += lint_layers(state, weights)
    refuse_errors(findings, "compile")
    return PipelineResult(gm, state.layers, state.upcast, config, findings, weights, auto)
