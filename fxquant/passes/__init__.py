"""The fxquant pass pipeline: freeze_params -> detect -> upcast -> quantize_linear -> fuse_linear -> cleanup."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx.passes.infra.pass_manager import PassManager

from fxquant.config import QuantConfig
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


def run_pipeline(gm: torch.fx.GraphModule, config: QuantConfig, example_inputs=None) -> PipelineResult:
    quantize, upcast = QuantizeLinear(config), Upcast()
    passes = [FreezeParams(example_inputs), Detect(), upcast, quantize, FuseLinear(), Cleanup()]
    result = PassManager(passes=passes, steps=1)(gm)
    return PipelineResult(result.graph_module, quantize.layers, upcast.upcast_nodes)
