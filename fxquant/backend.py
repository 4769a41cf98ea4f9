"""The dynamo backend: `torch.compile(model, backend="fxquant", options={...})`."""

from __future__ import annotations

import warnings

import torch
from torch._dynamo import list_backends, register_backend

from fxquant.config import MODES, from_options
from fxquant.passes.quantize_linear import quantize_weight
from fxquant.pipeline import PipelineResult, run_pipeline
from fxquant.report import format_report


class QuantizedCallable:
    """The compiled graph, plus a cheap check of each source weight's version on every call.

    A weight changed after compile (an optimizer step, a load_state_dict) is re-quantized into the same
    buffers, with one warning per compile; stale quantized weights are never used silently.
    """

    def __init__(self, compiled, result: PipelineResult, kept: list[int]):
        self.compiled, self.result, self.kept = compiled, result, kept  # kept: the inputs the compiled graph takes
        self.tracked = [layer for layer in result.layers if layer.source is not None]
        self.warned = False

    def __call__(self, *args):
        for layer in self.tracked:
            if layer.source._version != layer.version:
                self._requantize(layer)
        return self.compiled(*[args[i] for i in self.kept])

    def _requantize(self, layer):
        if not self.warned:
            warnings.warn(f"fxquant: weight of {layer.fqn} changed after compile; re-quantizing it "
                          "(this warning shows once per compile)", stacklevel=3)
            self.warned = True
        q = quantize_weight(layer.source.T if layer.transposed else layer.source, layer.recipe)
        fresh = (q.data, q.scale, q.global_scale, q.zero_point)
        with torch.no_grad():
            for name, tensor in zip(layer.buffers, fresh, strict=True):
                if name is None:
                    continue
                buffer = getattr(self.result.gm, name)
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
    result = run_pipeline(gm, config, example_inputs)
    _refuse_gradients(result.gm, example_inputs)
    result.warn()
    if config.report:
        print(format_report(result.layers, result.findings, result.weights))
    lowered, kept = _without_frozen_parameters(result.gm, example_inputs)
    example_inputs = [example_inputs[i] for i in kept]
    if config.inner == "eager":
        compiled = lowered.forward
    else:
        from torch._inductor.compile_fx import compile_fx

        # The pipeline added buffers dynamo never saw. Without dynamo's source map AOT treats every buffer as a
        # static input, which is what these frozen weights are (and what CUDA graphs want).
        if hasattr(lowered, "_param_name_to_source"):
            del lowered._param_name_to_source
        patches = {"triton.cudagraphs": True} if mode == "reduce-overhead" else {}
        if mode in ("max-autotune", "max-autotune-no-cudagraphs"):
            patches.update({"max_autotune": True})
        compiled = compile_fx(lowered, example_inputs, config_patches=patches)
    return QuantizedCallable(compiled, result, kept)


def _without_frozen_parameters(gm: torch.fx.GraphModule, example_inputs) -> tuple[torch.fx.GraphModule, list[int]]:
    """A copy of gm that no longer takes the parameters freeze_params made constants, and the positions of the
    inputs it still takes. gm keeps dynamo's calling convention; the copy shares its constants.

    A parameter merge_linear re-pointed into a stacked weight is a view at a storage offset, which a
    dynamic-shape recompile cannot fakify as a graph input; the lowered graph has no use for it anyway."""
    graph = torch.fx.Graph()
    graph._codegen = gm.graph._codegen
    graph.output(graph.graph_copy(gm.graph, {}))
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    kept = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if isinstance(value, torch.nn.Parameter) and not node.users:
            graph.erase_node(node)
        else:
            kept.append(i)
    lowered = torch.fx.GraphModule(gm, graph)
    # dynamo's meta (its compile id) tells AOT the graph came from dynamo, so that it counts the constants as
    # static inputs; without it, CUDA graphs copied every quantized weight into place on each replay.
    lowered.meta.update(gm.meta)
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
