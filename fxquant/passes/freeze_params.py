"""freeze_params: parameter placeholders become get_attr constants holding the real tensors.

Pre:  dynamo's graph takes parameters as placeholders (example inputs are the nn.Parameters themselves).
Post: every use of such a placeholder reads a get_attr node whose tensor is that parameter, and whose
      meta["fxquant_fqn"] is the parameter's fully qualified name (and meta["fxquant_parameter"] is True, as for
      an export graph's parameters, not its buffers); the placeholder stays, unused, so the
      graph's calling convention does not change.

    %l_self_modules_fc_parameters_weight_ : placeholder      ->  %fc_weight : get_attr[target=fc_weight]
    linear(%x, %l_self_modules_fc_parameters_weight_)        ->  linear(%x, %fc_weight)

Graphs from torch.export's ep.module() already hold parameters as get_attr: the pass only records names.
The compiled graph is for inference: gradients do not flow back to frozen parameters.
"""

from __future__ import annotations

import re

import torch
from torch.fx.passes.infra.pass_base import PassResult

from fxquant.passes.annotations import FQN_KEY, PARAMETER_KEY, SOURCE_KEY
from fxquant.passes.order import FxquantPass


def placeholder_fqn(node: torch.fx.Node) -> str:
    """The parameter's name under the compiled module: L['self']._modules['fc']._parameters['weight'] -> fc.weight."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    keys = re.findall(r"\['([^']+)'\]", source.name) if source is not None else []
    if len(keys) > 1:
        return ".".join(keys[1:])  # keys[0] is the local holding the module ('self')
    # No source recorded: l_self_modules_fc_parameters_weight_ -> fc.weight
    name = re.sub(r"^l_+[^_]+_+", "", node.name).rstrip("_")
    return re.sub(r"(^|_)(modules|parameters|buffers)_", ".", name).strip(".")


class FreezeParams(FxquantPass):
    name = "freeze_params"
    def __init__(self, example_inputs, parameter_names: dict[int, str] | None = None):
        super().__init__()
        self.example_inputs = list(example_inputs or [])
        self.parameter_names = parameter_names or {}  # id(parameter) -> its name in the model, where known

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, self.example_inputs, strict=False):
            if not isinstance(value, torch.nn.Parameter) or not node.users:
                continue
            fqn = self.parameter_names.get(id(value)) or placeholder_fqn(node)
            attr = "_fxq_param_" + re.sub(r"\W", "_", fqn)
            # A detached alias: same storage and version counter, but the inference graph tracks no grad.
            gm.register_buffer(attr, value.detach())
            with gm.graph.inserting_after(node):
                const = gm.graph.get_attr(attr)
            const.meta.update(node.meta)
            const.meta[FQN_KEY] = fqn
            const.meta[PARAMETER_KEY] = True
            const.meta[SOURCE_KEY] = value
            node.replace_all_uses_with(const)
            modified = True
        parameters = {name for name, _ in gm.named_parameters()}
        for node in gm.graph.nodes:
            if node.op == "get_attr" and FQN_KEY not in node.meta:
                node.meta[FQN_KEY] = node.target
                node.meta[PARAMETER_KEY] = node.target in parameters
        return PassResult(gm, modified)
