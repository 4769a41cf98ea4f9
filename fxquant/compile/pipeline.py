"""The pipeline: freeze_params -> localize_shards -> detect -> upcast, the numerics lint (and recipe="auto"'s
measurements), then quantize_linear -> fuse_norm -> merge_linear -> fuse_silu_mul -> fuse_linear -> pack_lanes
-> fuse_rotary_cache -> fuse_cache_length -> decode_attention -> pack_gqa -> fuse_attention_quant -> cleanup (the
norms and SiLU after the decode GEMMs keep their own kernels: docs/decisions/0027-row-work-stays-in-its-own-kernels.md).
It sits above the passes: they never import the lint or the measurements, and what they hand each other travels in
one `PipelineState`.

Each pass is timed and logged (logger "fxquant.compile.pipeline", one DEBUG line per pass: its time, whether it
changed the graph, its nodes before and after); the times are in `PipelineResult.timings`. With
FXQUANT_DUMP_GRAPHS=<folder>, each pass writes the graph it leaves there (`<run>-<NN>-<pass>.txt`, NN its place in
PASSES). The option `disable_passes` leaves out passes that only fuse or pack (`FxquantPass.optional`)."""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxquant.compile.capability import check_config, graph_device, usable_recipes
from fxquant.compile.lint import Finding, lint_graph, lint_layers, refuse_errors, warn_findings
from fxquant.compile.weights import WeightEntry, weight_inventory
from fxquant.config import AUTO, QuantConfig
from fxquant.passes.cleanup import Cleanup
from fxquant.passes.decode_attention import DecodeAttention
from fxquant.passes.detect import Detect
from fxquant.passes.freeze_params import FreezeParams
from fxquant.passes.fuse_attention_quant import FuseAttentionQuant
from fxquant.passes.fuse_cache_length import FuseCacheLength
from fxquant.passes.fuse_linear import FuseLinear
from fxquant.passes.fuse_norm import FuseNorm
from fxquant.passes.fuse_rotary_cache import FuseRotaryCache
from fxquant.passes.fuse_silu_mul import FuseSiluMul
from fxquant.passes.localize_shards import LocalizeShards
from fxquant.passes.merge_linear import MergeLinear
from fxquant.passes.pack_gqa import PackGQA
from fxquant.passes.pack_lanes import PackLanes
from fxquant.passes.quantize_linear import QuantizeLinear
from fxquant.passes.state import LayerRecord, PipelineState
from fxquant.passes.upcast import Upcast

log = logging.getLogger(__name__)
PASS_TYPES = (FreezeParams, LocalizeShards, Detect, Upcast, QuantizeLinear, FuseNorm, MergeLinear, FuseSiluMul,
              FuseLinear, PackLanes, FuseRotaryCache, FuseCacheLength, DecodeAttention, PackGQA,
              FuseAttentionQuant, Cleanup)
PASSES = tuple(pass_type.name for pass_type in PASS_TYPES)
PREPARE = PASSES[:4]  # the graph annotated and upcast, nothing quantized
OPTIONAL = tuple(pass_type.name for pass_type in PASS_TYPES if pass_type.optional)
_RUNS, _RUN_KEY = itertools.count(), "fxquant_dump_run"  # numbers each pipeline run's dumped graphs (in gm.meta)


@dataclass(frozen=True)
class PassTiming:
    name: str
    seconds: float
    modified: bool
    nodes: tuple[int, int]  # the graph's nodes before and after the pass


@dataclass
class PipelineResult:
    gm: torch.fx.GraphModule
    layers: list[LayerRecord]
    upcast: list[str]
    config: QuantConfig  # with recipe="auto" resolved to per-layer recipes
    findings: list[Finding]  # the numerics lint's, errors excluded (those refuse the compile)
    weights: list[WeightEntry]  # every parameter the graph reads, for the report's totals
    auto: list = field(default_factory=list)  # recipe="auto"'s measurements (measure.LayerError), for the report
    timings: list[PassTiming] = field(default_factory=list)  # the passes run, in order

    def warn(self) -> None:
        """One warning per compile listing every warning-level finding."""
        warn_findings(self.findings, stacklevel=3)


def prepare(gm: torch.fx.GraphModule, state: PipelineState, example_inputs=None,
            parameter_names: dict[int, str] | None = None, stop_after: str | None = None,
            timings: list[PassTiming] | None = None) -> torch.fx.GraphModule:
    """freeze_params -> localize_shards -> detect -> upcast: the graph annotated, with its reductions in fp32, not yet
    quantized. parameter_names (id of a parameter -> its name in the model) names layers from the model's root where the
    caller holds the model: dynamo names them from the compiled frame's module, a submodule after a graph break."""
    passes = [FreezeParams(example_inputs, parameter_names), LocalizeShards(), Detect(), Upcast(state)]
    return _run(passes, gm, state.config, stop_after, timings)


def _run(passes, gm: torch.fx.GraphModule, config: QuantConfig, stop_after: str | None = None,
         timings: list[PassTiming] | None = None) -> torch.fx.GraphModule:
    """Each pass once, in order, up to the one named stop_after, leaving out config.disable_passes. A pass's graph is
    recompiled where the pass changed it (`FxquantPass.__call__`); torch's PassManager would recompile after every
    pass, changed or not:
    4.0 of the pipeline's 7.5 s in a cProfile of a 32-layer compile
    (docs/decisions/0013-pipeline-recompiles-only-changed-graphs.md)."""
    dump = os.environ.get("FXQUANT_DUMP_GRAPHS")
    if dump and _RUN_KEY not in gm.meta:  # one number for the graph's whole pipeline (prepare, then the rest)
        gm.meta[_RUN_KEY] = next(_RUNS)
    for run_pass in passes:
        if run_pass.name not in config.disable_passes:
            before, start = len(gm.graph.nodes), time.perf_counter()
            result = run_pass(gm)
            gm = result.graph_module
            timing = PassTiming(run_pass.name, time.perf_counter() - start, bool(result.modified),
                                (before, len(gm.graph.nodes)))
            log.debug("%s: %.1f ms, %s, %d -> %d nodes", timing.name, 1e3 * timing.seconds,
                      "changed" if timing.modified else "unchanged", *timing.nodes)
            if timings is not None:
                timings.append(timing)
            if dump:
                _dump(gm, Path(dump) / f"{gm.meta[_RUN_KEY]}-{PASSES.index(run_pass.name):02d}-{run_pass.name}.txt")
        if run_pass.name == stop_after:
            break
    return gm


def _dump(gm: torch.fx.GraphModule, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(gm.print_readable(print_output=False))


def check_disabled(config: QuantConfig) -> None:
    """disable_passes names passes that may be left out, or the compile is refused naming them."""
    unknown = [name for name in config.disable_passes if name not in PASSES]
    required = [name for name in config.disable_passes if name in PASSES and name not in OPTIONAL]
    if unknown or required:
        problem = (f"there is no pass {', '.join(unknown)}" if unknown else
                   f"{', '.join(required)} cannot be left out (the passes that annotate, upcast, quantize or clean "
                   f"the graph run always)")
        raise ValueError(f"fxquant: disable_passes: {problem}; the passes it may leave out: {', '.join(OPTIONAL)}")


def run_pipeline(gm: torch.fx.GraphModule, config: QuantConfig, example_inputs=None, *,
                 stop_after: str | None = None) -> PipelineResult:
    """The whole pipeline; recipe="auto" measures each unpinned layer on example_inputs (real tensors) first.

    stop_after: the name of a pass (PASSES); the pipeline stops after it and the result holds the graph as that pass
    leaves it, for a test or a look at one pass's work. A run that stops in the preparation (PREPARE) lints the graph
    but quantizes nothing."""
    if stop_after is not None and stop_after not in PASSES:
        raise ValueError(f"fxquant: no pass {stop_after!r}; the pipeline's passes: {', '.join(PASSES)}")
    check_disabled(config)
    device = graph_device(gm, example_inputs)
    check_config(config, device)
    state, timings = PipelineState(config), []
    gm = prepare(gm, state, example_inputs, stop_after=stop_after, timings=timings)
    weights = weight_inventory(gm)
    findings, auto = lint_graph(gm, example_inputs), []
    if stop_after in PREPARE:
        refuse_errors(findings, "compile")
        return PipelineResult(gm, state.layers, state.upcast, config, findings, weights, timings=timings)
    if config.recipe == AUTO:
        from fxquant.compile.measure import measure_graph, resolve_auto

        if example_inputs is None:
            raise ValueError("fxquant: recipe='auto' needs sample inputs to measure each layer on")
        measured = auto = measure_graph(gm, example_inputs, config, usable_recipes(device))
        state.config = config = resolve_auto(config, measured)
        state.auto_reasons = {m.fqn: m.reason for m in measured if m.chosen_by_auto and m.recipe is None}
    gm = _run([QuantizeLinear(state), FuseNorm(state), MergeLinear(state), FuseSiluMul(), FuseLinear(),
               PackLanes(state), FuseRotaryCache(state), FuseCacheLength(state), DecodeAttention(state), PackGQA(),
               FuseAttentionQuant(), Cleanup()], gm, config, stop_after, timings)
    findings += lint_layers(state, weights)
    refuse_errors(findings, "compile")
    return PipelineResult(gm, state.layers, state.upcast, config, findings, weights, auto, timings)
