"""`quantize_(model, config)`: quantize a model's linear layers and MoE experts in place, freeing their
high-precision weights."""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from fxquant.compile.lint import Finding, lint_layers, refuse_errors, warn_findings, weight_findings
from fxquant.compile.pipeline import prepare
from fxquant.compile.report import format_report
from fxquant.compile.weights import WeightEntry, weight_role
from fxquant.config import AUTO, QuantConfig, from_options
from fxquant.modules.quantized_experts import (
    PROJECTIONS,
    QuantizedExperts,
    experts_layout_reason,
    is_experts,
    stored_transposed,
)
from fxquant.modules.quantized_linear import FrozenParts, QuantizedLinear
from fxquant.modules.sharded_linear import LAYOUT_REASON, local, move_hooks, shard_dim
from fxquant.passes.annotations import annotation
from fxquant.passes.state import LayerRecord, PipelineState
from fxquant.quantization.weight_quantization import (
    ALIGNMENT,
    ROUTER_REASON,
    SHARD_HINT,
    shared_weight_reason,
    skip_reason,
    weight_sqnrs,
)


def linear_weight(module: nn.Module) -> torch.Tensor | None:
    """A linear layer's weight as [N, K]: nn.Linear's own, GPT-2's Conv1D's [K, N] transposed; else None."""
    if isinstance(module, nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "weight", None), torch.Tensor):
        return module.weight.T  # transformers' Conv1D: y = x @ W + b with W [in, out]
    return None


def _routers(model: nn.Module, example_inputs) -> set[str]:
    """Names of the linears whose output selects experts, found in the graphs of one run on example_inputs."""
    found: set[str] = set()
    names = {id(param): name for name, param in model.named_parameters()}  # as quantize_ names the layers

    def capture(gm, inputs):
        gm = prepare(gm, PipelineState(QuantConfig()), inputs, names)
        found.update(a.fqn for node in gm.graph.nodes if (a := annotation(node)) is not None and a.router)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=capture)(*example_inputs)
    torch._dynamo.reset()
    return found


def sharded_reason(weight: torch.Tensor, bias, fqn: str, config: QuantConfig) -> str | None:
    """skip_reason for the weight as this rank holds it: a tensor-parallel weight's local shard, in a layout
    `shard_dim` takes, with the hint to reshard where the shard splits the recipe's blocks."""
    reason = skip_reason(local(weight), fqn, config)
    if not isinstance(weight, DTensor) or (reason and not reason.startswith(ALIGNMENT)):
        return reason
    if shard_dim(weight, bias, config.recipe_for(fqn)) is None:  # before alignment: every rank gives one reason
        return LAYOUT_REASON
    return f"{reason} {SHARD_HINT}" if reason else None


def _shared(model: nn.Module) -> dict[int, list[str]]:
    """Modules reading each parameter, for parameters more than one module reads (a tied lm_head)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    return {key: names for key, names in owners.items() if len(names) > 1}


def quantize_(model: nn.Module, config: QuantConfig | dict | None = None, *, example_inputs=None,
              progress: bool | None = None) -> nn.Module:
    """Replace each linear layer the config selects (nn.Linear, Conv1D) by a `QuantizedLinear`, and each MoE
    layer's experts (transformers' 3-D gate_up_proj / down_proj) by `QuantizedExperts`, in place, one layer at a
    time on the weight's device, and drop the high-precision weights: peak memory stays near the model's plus one
    layer's temporaries. Returns the model.

    `config` is a QuantConfig or the backend's options dict. `example_inputs` (a tuple of positional arguments)
    lets routers be found by structure, as the backend finds them (their output feeds a top-k), and is required
    by recipe="auto", which measures each layer on them. A weight that another module also reads (a tied
    lm_head and its embedding) stays in high precision. With report=True the per-layer table is printed.

    It speaks as the backend's numerics lint does: a weight holding inf or NaN is refused (`NumericsError`, naming
    the layer) before anything is changed, and one warning names each layer kept for its shape and each weight
    whose scales outliers made coarse. `progress` shows a bar over the layers (None: on a terminal only).
    """
    config = from_options(config)
    args = tuple(example_inputs) if isinstance(example_inputs, tuple | list) else (
        () if example_inputs is None else (example_inputs,))
    # Names, not modules: a list of the modules would keep every replaced layer's high-precision weight alive
    # until the end, and the peak would be the whole model twice over.
    names = [fqn for fqn, module in model.named_modules() if linear_weight(module) is not None]
    experts = [fqn for fqn, module in model.named_modules() if is_experts(module)]
    findings = weight_findings_of(model, names, experts)
    refuse_errors(findings, "quantize_")
    auto = []
    if config.recipe == AUTO:
        if not args:
            raise ValueError("fxquant: quantize_ with recipe='auto' needs example_inputs to measure each layer on")
        from fxquant.compile.inspection import inspect

        report = inspect(model, args, config)
        config, auto = report.config, report.layers
    routers = _routers(model, args) if args else set()
    layers = _already_quantized(model, config)
    layers += quantize_layers(model, names, experts, config, routers, progress)
    finish(model, config, layers, findings, auto)
    return model


def quantize_layers(model: nn.Module, names: list[str], experts: list[str], config: QuantConfig,
                    routers: set[str] = frozenset(), progress: bool | None = None) -> list[LayerRecord]:
    """quantize_'s swaps: each linear of `names` and each experts module of `experts` quantized in place unless a
    reason keeps it; a record for each. Their weights' findings are the caller's to have checked."""
    shared, layers = _shared(model), []
    for fqn in tqdm(names, desc="fxquant quantize_", unit="layer", disable=progress_hidden(progress)):
        module = model.get_submodule(fqn)
        weight = linear_weight(module)
        others = [name for name in shared.get(id(module.weight), ()) if name != fqn]
        reason = ROUTER_REASON if fqn in routers else (
            shared_weight_reason(others) if others
            else sharded_reason(weight, module.bias, fqn, config))
        before = local(weight).numel() * weight.element_size()  # a tensor-parallel layer: this rank's share
        if reason:
            layers.append(LayerRecord(fqn, tuple(weight.shape), None, reason, before, before))
            continue
        recipe = config.recipe_for(fqn)
        with torch.no_grad():
            if isinstance(weight, DTensor):
                dim = shard_dim(weight, module.bias, recipe)
                quantized = QuantizedLinear.from_sharded_weight(weight, module.bias, recipe, dim)
            else:
                quantized = QuantizedLinear.from_weight(weight, module.bias, recipe)
        move_hooks(module, quantized)
        parent, _, attr = fqn.rpartition(".")
        setattr(model.get_submodule(parent), attr, quantized)
        sqnr, worst = weight_sqnrs(quantized.quantized_weight(), local(weight))
        dtype, device = weight.dtype, weight.device
        del module, weight  # the last references to the high-precision weight: freed now
        after = sum(local(p).numel() * p.element_size() for name, p in quantized.named_parameters() if name != "bias")
        layers.append(LayerRecord(fqn, (quantized.out_features, quantized.in_features), recipe, "", before, after,
                                  weight_sqnr=sqnr, worst_row_sqnr=worst, dtype=dtype, device=device))
    for fqn in experts:
        layers += _quantize_experts(model, fqn, config)
    return layers


def finish(model: nn.Module, config: QuantConfig, layers: list[LayerRecord], findings: list[Finding],
           auto=()) -> None:
    """After the swaps: the lint's findings on what was kept and how (one warning), and the report if asked."""
    weights = _other_weights(model, layers)
    findings = findings + lint_layers(PipelineState(config, layers=layers), weights)
    warn_findings(findings, stacklevel=3)
    if config.report:
        print(format_report(layers, findings, weights, auto))


def progress_hidden(progress: bool | None) -> bool | None:
    """tqdm's `disable`: None hides the bar where the output is no terminal (logs, CI)."""
    return None if progress is None else not progress


def weight_findings_of(model: nn.Module, linears: list[str], experts: list[str]) -> list[Finding]:
    """The lint's findings on every linear and experts weight (inf/NaN: errors; past fp16's range: warnings), all
    found before any layer is changed, so that a refusal leaves the model as it was."""
    findings = []
    for fqn in linears:
        findings += weight_findings(fqn, local(linear_weight(model.get_submodule(fqn))))
    for fqn in experts:
        module = model.get_submodule(fqn)
        for projection in PROJECTIONS:
            findings += weight_findings(f"{fqn}.{projection}", getattr(module, projection))
    return findings


def _already_quantized(model: nn.Module, config: QuantConfig) -> list[LayerRecord]:
    """A record for each layer an earlier quantize_ (or a checkpoint) quantized: kept as it is, since quantizing its
    codes again would round twice. Where this call's config selects one under another recipe, one warning names
    them and the fix."""
    layers, differ = [], []
    for fqn, module in model.named_modules():
        if not isinstance(module, QuantizedLinear | QuantizedExperts):
            continue
        nbytes = sum(getattr(module, n).numel() * getattr(module, n).element_size() for n in module.part_names()
                     if getattr(module, n) is not None)
        shape = ((module.out_features, module.in_features) if isinstance(module, QuantizedLinear)
                 else (module.num_experts, 2 * module.intermediate_dim, module.hidden_dim))
        layers.append(LayerRecord(fqn, shape, module.recipe, "already quantized, kept", nbytes, nbytes))
        asked = None if config.skip_reason(fqn) else config.layer_recipe(fqn) or (
            config.recipe if config.recipe != AUTO else None)
        if asked is not None and asked != module.recipe:
            differ.append(f"{fqn} ({module.recipe})")
    if differ:
        warnings.warn(f"fxquant: quantize_ keeps {len(differ)} layer(s) already quantized under another recipe than "
                      f"the one asked for: {', '.join(differ[:6])}{' and more' if len(differ) > 6 else ''}. "
                      "Quantizing codes again would round twice. Fix: quantize_ the high-precision model (or load "
                      "its checkpoint) with the recipe wanted, or skip those layers", stacklevel=3)
    return layers


def _quantize_experts(model: nn.Module, fqn: str, config: QuantConfig) -> list[LayerRecord]:
    """Swap the experts module `fqn` for a QuantizedExperts unless a reason keeps it; a record per projection."""
    module = model.get_submodule(fqn)
    transposed = stored_transposed(module)  # stored [E, K, N]; judged and reported as [E, N, K]
    weights = {p: getattr(module, p).transpose(-2, -1) if transposed else getattr(module, p) for p in PROJECTIONS}
    names = {projection: f"{fqn}.{projection}" for projection in PROJECTIONS}
    reasons = [experts_layout_reason(module)] + [skip_reason(w, names[p], config, dims=3) for p, w in weights.items()]
    recipes = set() if any(reasons) else {config.recipe_for(name) for name in names.values()}
    if len(recipes) > 1:
        reasons.append(f"its projections ask for different recipes ({', '.join(sorted(recipes))})")
    reason = "; ".join(dict.fromkeys(r for r in reasons if r))
    before = {p: w.numel() * w.element_size() for p, w in weights.items()}
    shapes = {p: tuple(w.shape) for p, w in weights.items()}
    if reason:
        return [LayerRecord(names[p], shapes[p], None, reason, before[p], before[p]) for p in PROJECTIONS]
    recipe = recipes.pop()
    with torch.no_grad():
        quantized = QuantizedExperts.from_module(module, recipe)
    parent, _, attr = fqn.rpartition(".")
    setattr(model.get_submodule(parent), attr, quantized)
    del module, weights  # the last references to the high-precision experts
    records = []
    for projection in PROJECTIONS:
        parts = [getattr(quantized, name) for name in quantized.part_names()
                 if name.startswith(projection) and getattr(quantized, name) is not None]
        records.append(LayerRecord(names[projection], shapes[projection], recipe, "", before[projection],
                                   sum(p.numel() * p.element_size() for p in parts)))
    return records


def _other_weights(model: nn.Module, layers: list[LayerRecord]) -> list[WeightEntry]:
    """The model's parameters other than linear weights and experts, each once, with the role the report totals
    them by."""
    # Linear weights (a tied lm_head's too, which its embedding also reads) and kept experts are in the layer
    # records already.
    seen = {id(module.weight) for module in model.modules() if linear_weight(module) is not None}
    recorded = {layer.fqn for layer in layers}
    seen |= {id(param) for name, param in model.named_parameters() if name in recorded}
    entries = []
    for name, module in model.named_modules():
        for key, param in module.named_parameters(recurse=False):
            if id(param) in seen or (isinstance(module, FrozenParts) and key in module.part_names()):
                continue
            seen.add(id(param))
            # No graph says what reads a 3-D parameter here: a module or parameter named for experts (a MoE layer
            # quantize_ does not recognise) holds expert stacks; others (ViT's position embeddings) do not.
            role = weight_role(param, embedding=isinstance(module, nn.Embedding),
                               convolution=isinstance(module, nn.modules.conv._ConvNd),
                               product="expert" in f"{type(module).__name__}.{key}".lower())
            entries.append(WeightEntry(f"{name}.{key}" if name else key, tuple(param.shape),
                                       param.numel() * param.element_size(), role, name))
    return entries
