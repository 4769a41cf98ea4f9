"""The fxquant pass pipeline: freeze_params -> detect -> upcast -> quantize_linear -> fuse_linear -> cleanup."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.infra.pass_manager import PassManager

from fxquant.config import AUTO, QuantConfig
from fxquant.passes.cleanup import Cleanup
from fxquant.passes.detect import Detect
from fxquant.passes.freeze_params import FreezeParams
from fxquant.passes.fuse_linear import FuseLinear
from fxquant.passes.quantize_linear import LayerRecord, QuantizeLinear
from fxquant.passes.upcast import Upcast


@dataclass
class PipelineResult:
    gm: torch.fx.GraphModule
    layers: list[LayerRecord]
    upcast: list[str]
    config: QuantConfig  # with recipe="auto" resolved to per-layer recipes


def prepare(gm: torch.fx.GraphModule, example_inputs=None) -> tuple[torch.fx.GraphModule, Upcast]:
    """freeze_params -> detect -> upcast: the graph annotated, with its reductions in fp32, not yet quantized."""
    upcast = Upcast()
    result = PassManager(passes=[FreezeParams(example_inputs), Detect(), upcast], steps=1)(gm)
    return result.graph_module, upcast


def run_pipeline(gm: torch.fx.GraphModule, config: QuantConfig, example_inputs=None) -> PipelineResult:
    """The whole pipeline; recipe="auto" measures each unpinned layer on example_inputs (real tensors) first."""
    gm, upcast = prepare(gm, example_inputs)
    if config.recipe == AUTO:
        from fxquant.measure import measure_graph, resolve_auto

        if example_inputs is None:
            raise ValueError("fxquant: recipe='auto' needs sample inputs to measure each layer on")
        config = resolve_auto(config, measure_graph(gm, example_inputs, config))
    quantize = QuantizeLinear(config)
    result = PassManager(passes=[quantize, FuseLinear(), Cleanup()], steps=1)(gm)
    return PipelineResult(result.graph_module, quantize.layers, upcast.upcast_nodes, config)
