"""The dynamo backend: `torch.compile(model, backend="fxquant", options={...})`."""

from __future__ import annotations

import functools
import operator
import warnings
from dataclasses import dataclass, field

import torch
from torch._dynamo import list_backends, register_backend
from torch._dynamo.source import ConstantSource

from fxquant.compile.pipeline import PipelineResult, run_pipeline
from fxquant.compile.report import format_report
from fxquant.config import MODES, from_options
from fxquant.kernels.dependent_launch import launching_dependent
from fxquant.quantization.weight_quantization import quantize_weight
from fxquant.quantization.weight_store import WATCHED_KEY, refresh_lanes, stored_layout

VERSION = operator.attrgetter("_version")


@dataclass
class Variant:
    """The graph compiled for one set of parameters: the compiled callable, the pipeline's result, the inputs the
    compiled graph takes, and the parameters frozen into it (in the graph's input order).

    The per-call checks iterate in C (itemgetter, map), not in Python: a 32-layer decode graph takes about 400
    inputs, 290 of them frozen parameters, and quantizes 224 weights whose versions are checked on every call."""

    compiled: object
    result: PipelineResult
    kept: list[int]
    params: list[torch.Tensor]
    tracked: list = field(default_factory=list)  # layers whose source weight's version is checked on each call
    # their source weights, then the model's quantized parameters that per-lane copies follow (pack_lanes)
    sources: tuple = ()
    versions: tuple = ()  # the versions the quantized buffers and the copies hold
    take: object = None  # args -> the inputs the compiled graph takes, as a tuple

    def __post_init__(self):
        self.tracked = [layer for layer in self.result.layers if layer.source is not None]
        followed = tuple(self.result.gm.meta.get(WATCHED_KEY, ()))
        self.sources = tuple(layer.source for layer in self.tracked) + followed
        self.versions = tuple(layer.version for layer in self.tracked) + tuple(map(VERSION, followed))
        self.take = _getter(self.kept)


def _getter(indices: list[int]):
    """args -> tuple(args[i] for i in indices), in C."""
    if len(indices) == 1:
        return lambda args, index=indices[0]: (args[index],)
    return operator.itemgetter(*indices) if indices else lambda args: ()


class QuantizedCallable:
    """The compiled graph, plus two cheap checks on every call.

    - The parameters must be those the graph froze and quantized. Dynamo takes a module's parameters as graph
      inputs and may reuse one graph for another module of the same class (a layer compiled on its own, a graph
      break inside a loop over experts); frozen weights cannot serve it, so each set of parameters gets a variant
      compiled from a pristine copy of the graph, once, with one warning per compile.
    - A weight changed after compile (an optimizer step, a load_state_dict) is re-quantized into the same
      buffers, with one warning per compile; stale quantized weights are never used silently. A quantized
      parameter changed after compile (a load_state_dict into quantize_'s scales) re-packs the per-lane copies that
      follow it (pack_lanes), silently: the model's own state changed, and nothing was re-quantized.
    """

    def __init__(self, original: torch.fx.GraphModule, frozen: list[int], compile_variant, example_inputs):
        self.original, self.frozen, self.compile_variant = original, frozen, compile_variant
        self.variant = compile_variant(_graph_copy(original) if frozen else original, example_inputs)
        self.variants = {self._key(example_inputs): self.variant}
        self.warned = set()
        self.take_frozen = _getter(frozen)

    @property
    def result(self) -> PipelineResult:
        return self.variant.result

    def _key(self, args) -> tuple[int, ...]:
        return tuple(id(args[i]) for i in self.frozen)

    def __call__(self, *args):
        variant = self.variant
        if self.frozen and not all(map(operator.is_, self.take_frozen(args), variant.params)):
            variant = self.variant = self._variant_for(args)
        if tuple(map(VERSION, variant.sources)) != variant.versions:
            for layer in variant.tracked:
                if layer.source._version != layer.version:
                    self._requantize(variant, layer)
            refresh_lanes(variant.result.gm)
            variant.versions = tuple(map(VERSION, variant.sources))
        return variant.compiled(*variant.take(args))

    def _variant_for(self, args) -> Variant:
        found = self.variants.get(self._key(args))
        if found is not None and all(map(operator.is_, self.take_frozen(args), found.params)):
            return found
        if "variant" not in self.warned:
            warnings.warn("fxquant: dynamo reuses this compiled graph for another module's parameters; compiling a "
                          "variant with them quantized (once per set of parameters; this warning shows once per "
                          "compile)", stacklevel=3)
            self.warned.add("variant")
        found = self.variants[self._key(args)] = self.compile_variant(_graph_copy(self.original), args)
        return found

    def _requantize(self, variant: Variant, layer):
        if "requantize" not in self.warned:
            warnings.warn(f"fxquant: weight of {layer.fqn} changed after compile; re-quantizing it "
                          "(this warning shows once per compile)", stacklevel=3)
            self.warned.add("requantize")
        q = quantize_weight(layer.source.transpose(-2, -1) if layer.transposed else layer.source, layer.recipe)
        q = stored_layout(q, layer.tiled)
        with torch.no_grad():
            for tensor_name, name in layer.buffers._asdict().items():  # QuantizedBuffers names Quantized's fields
                if name is None:
                    continue
                tensor = getattr(q, tensor_name)
                buffer = getattr(variant.result.gm, name)
                if layer.rows is not None:  # merged with its siblings: its share of the stacked rows
                    first, stop, of = layer.rows
                    buffer = buffer[first * buffer.shape[0] // of: stop * buffer.shape[0] // of]
                buffer.copy_(tensor)
        layer.version = layer.source._version


def fxquant(gm: torch.fx.GraphModule, example_inputs, *, options=None, mode=None):
    """Quantize the graph per `options` (see `fxquant.config.QuantConfig`), then lower it."""
    config = from_options(options)
    mode = mode or config.mode  # torch.compile(mode=...) or options={"mode": ...}
    if mode not in MODES:
        raise ValueError(f"fxquant: unknown mode {mode!r}; valid: {', '.join(map(str, MODES))}")
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    frozen = [i for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=False))
              if isinstance(value, torch.nn.Parameter) and node.users]
    return QuantizedCallable(gm, frozen, functools.partial(_compile, config=config, mode=mode, frozen=frozen),
                             example_inputs)


def _compile(gm: torch.fx.GraphModule, example_inputs, *, config, mode, frozen) -> Variant:
    """The pipeline, then the inner compiler, on gm (which the pipeline rewrites) for these inputs."""
    result = run_pipeline(gm, config, example_inputs)
    _refuse_gradients(result.gm, example_inputs)
    result.warn()
    if config.report:
        print(format_report(result.layers, result.findings, result.weights, result.auto))
    lowered, kept = _without_frozen_parameters(result.gm, example_inputs)
    inputs = [example_inputs[i] for i in kept]
    if config.inner == "eager":
        compiled = lowered.forward
    else:
        from torch._inductor.compile_fx import compile_fx

        _name_added_constants(lowered)
        patches = {"triton.cudagraphs": True} if mode == "reduce-overhead" else {}
        if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            patches.update({"max_autotune": True})
        # Inductor's kernels launched dependent too, as fxquant's are (sm_90+; Inductor checks the GPU): int4_wo's
        # 32-layer decode step took 0.14 / 0.19 ms less at B1 / B16 on the H100
        # (docs/decisions/0032-inductor-kernels-launched-dependent.md)
        patches["triton.enable_pdl"] = launching_dependent()
        patches.update(config.inductor)
        compiled = compile_fx(lowered, inputs, config_patches=patches)
    return Variant(compiled, result, kept, [example_inputs[i] for i in frozen])


def _name_added_constants(gm: torch.fx.GraphModule) -> None:
    """Give each constant the pipeline added a source in dynamo's map of gm's parameters and buffers.

    AOT reads a dynamo graph's static inputs from that map and from its placeholders: every mapped parameter or
    buffer, and every input dynamo marked static (a StaticCache's keys, values and length, which the graph writes in
    place). Without the map it counts buffers alone, and CUDA graphs skip a graph that writes an input they do not
    hold static. The added constants are never another input's alias, so no guard reads their sources."""
    if not hasattr(gm, "_param_name_to_source"):
        return
    sources = dict(gm._param_name_to_source)  # dynamo's own dict stays as it was
    for name, _ in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        sources.setdefault(name, ConstantSource(f"fxquant.{name}"))
    gm._param_name_to_source = sources


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of gm's graph (its nodes, each with a shallow copy of its meta and dynamo's source of each input) over
    gm's attributes, with gm's meta: for the pipeline to rewrite while gm stays as dynamo gave it."""
    graph, copies = torch.fx.Graph(), {}
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, copies))
    for node, copy in copies.items():
        if hasattr(node, "_dynamo_source"):
            copy._dynamo_source = node._dynamo_source
    copied = torch.fx.GraphModule(gm, graph)
    copied.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copied._param_name_to_source = gm._param_name_to_source
    return copied


def _without_frozen_parameters(gm: torch.fx.GraphModule, example_inputs) -> tuple[torch.fx.GraphModule, list[int]]:
    """A copy of gm that no longer takes the parameters freeze_params made constants, and the positions of the
    inputs it still takes. gm keeps dynamo's calling convention; the copy shares its constants.

    A parameter merge_linear re-pointed into a stacked weight is a view at a storage offset, which a
    dynamic-shape recompile cannot fakify as a graph input; the lowered graph has no use for it anyway."""
    lowered = _graph_copy(gm)  # with dynamo's meta, so that AOT counts the constants as static inputs (CUDA graphs
    # copied every quantized weight into place on each replay without it)
    kept = []
    placeholders = [node for node in lowered.graph.nodes if node.op == "placeholder"]
    for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if isinstance(value, torch.nn.Parameter) and not node.users:
            lowered.graph.erase_node(node)
        else:
            kept.append(i)
    lowered.recompile()
    return lowered, kept


def _refuse_gradients(gm: torch.fx.GraphModule, example_inputs) -> None:
    """The quantized graph has no backward: with grad mode on, an input that requires grad is refused, with the fix,
    rather than differentiated through the rounding (frozen parameters never require it)."""
    if not torch.is_grad_enabled() or not any(str(node.target).startswith("fxquant.") for node in gm.graph.nodes):
        return
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    needing = [node.name for node, value in zip(placeholders, example_inputs, strict=False)
               if node.users and isinstance(value, torch.Tensor) and value.requires_grad]
    if needing:
        raise RuntimeError(f"fxquant: the quantized graph is for inference, but input(s) {needing} require grad. "
                           "Fix: run the model under torch.no_grad() or torch.inference_mode(), or detach its inputs")


# Installed packages name the backend through the `torch_dynamo_backends` entry point, which dynamo loads
# (and registers) on first use; register here only where no entry point exists (a source checkout).
if "fxquant" not in list_backends(exclude_tags=()):
    register_backend(fxquant, name="fxquant")
