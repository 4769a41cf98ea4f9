"""`fxquant.inspect`: what a recipe does to each linear layer of a model, measured on sample inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxquant.compile.capability import check_config, graph_device, usable_recipes
from fxquant.compile.measure import LayerError, measure_graph, resolve_auto
from fxquant.compile.pipeline import prepare
from fxquant.compile.report import format_rows
from fxquant.config import QuantConfig, from_options
from fxquant.passes.state import PipelineState


@dataclass
class InspectReport:
    """Per-layer SQNRs (dB) of the recipe, and the config that reproduces the choices (recipe="auto")."""

    layers: list[LayerError]
    config: QuantConfig

    def table(self) -> str:
        rows = [("layer", "shape [N, K]", "recipe", "weight SQNR", "act SQNR", "output SQNR")]
        for m in self.layers:
            rows.append((m.fqn, "x".join(map(str, m.shape)), m.recipe or f"skipped: {m.reason}",
                         _db(m.weight_sqnr), _db(m.act_sqnr), _db(m.out_sqnr)))
        return "fxquant inspect (SQNR in dB against an fp32 shadow of each layer)\n" + "\n".join(format_rows(rows))

    def __str__(self) -> str:
        return self.table()


def _db(value: float | None) -> str:
    if value is None:
        return "-"
    return "exact" if math.isinf(value) else f"{value:.1f}"


def inspect(model: torch.nn.Module, example_inputs, config: QuantConfig | dict | None = None, *,
            verbose: bool = False) -> InspectReport:
    """Run `model` once on `example_inputs` (a tuple of positional arguments) and measure, per quantizable
    linear layer, the weight, activation and output SQNR of the recipe against an fp32 shadow of that layer.

    `config` is a QuantConfig or the backend's options dict. With recipe="auto" each layer gets the cheapest
    recipe whose output SQNR meets `min_sqnr_db`; pass the returned `report.config` to torch.compile's
    `options=` or to `fxquant.export` to quantize with those choices.
    """
    config = from_options(config)
    layers: list[LayerError] = []
    names = {id(param): name for name, param in model.named_parameters()}  # layers named from the model's root

    def capture(gm, inputs):
        device = graph_device(gm, inputs)
        check_config(config, device)
        gm = prepare(gm, PipelineState(config), inputs, names)
        layers.extend(measure_graph(gm, inputs, config, usable_recipes(device)))
        return gm.forward

    args = example_inputs if isinstance(example_inputs, tuple | list) else (example_inputs,)
    # A fresh dynamo and static shapes: after other compiles of the same forward at other shapes, dynamo's
    # automatic dynamic shapes gave the capture symbolic sizes, which measuring on real tensors cannot run.
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=False)(*args)
    torch._dynamo.reset()
    report = InspectReport(layers, resolve_auto(config, layers))
    if verbose:
        print(report.table())
    return report
