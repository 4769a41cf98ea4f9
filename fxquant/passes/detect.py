"""detect: annotate linear, experts, rms_norm, layer_norm and softmax nodes, in every spelling dynamo and export use.

Pre:  any graph (torch-level from dynamo, aten-level from torch.export), after freeze_params.
Post: node.meta["fxquant"] = Annotation(kind, fqn, router) on each found node; the graph itself is unchanged.

Spellings are `spellings.py`'s; a linear is any form `patterns.linear_operands` matches (F.linear, and addmm / mm /
matmul with a constant 2-D weight on the right, as GPT-2's Conv1D, or with its transpose, x @ w.T); an MoE layer's
expert product is any form `patterns.expert_operands` matches (grouped_mm over a 3-D parameter, bmm of its rows
picked by expert id); a hand-written RMSNorm's variance is annotated on its pow node when
`patterns.match_rms_variance` matches. A linear whose output selects experts (feeds a top-k) is marked as a router.

A linear's name is the weight's owner (q_proj.weight -> q_proj) when the module running it holds the weight;
a module that reads another's weight (a tied lm_head on the embedding's) is named by its own path.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

from fxquant.passes.annotations import FQN_KEY, META_KEY, Annotation, module_path
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import expert_operands, linear_operands, match_rms_variance, selects_experts
from fxquant.passes.spellings import LAYER_NORM, RMS_NORM, SOFTMAX, target_of


def _linear_fqn(node: torch.fx.Node, weight) -> str | None:
    weight_fqn = weight.meta.get(FQN_KEY) if isinstance(weight, torch.fx.Node) else None
    owner = weight_fqn.rpartition(".")[0] if weight_fqn and "." in weight_fqn else None
    path = module_path(node)
    # The module running it owns the weight when its path (relative to the compiled frame's module, after a graph
    # break) runs along the owner's: layers.0.mlp in model.layers.0.mlp.experts.
    if path and (owner is None or f".{path}." not in f".{owner}."):
        return path  # the weight belongs to another module (tied): name the layer that runs it
    if weight_fqn and weight_fqn.endswith(".weight"):
        return weight_fqn[: -len(".weight")]
    return weight_fqn or path


class Detect(FxquantPass):
    name = "detect"
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        for node in gm.graph.nodes:
            target = target_of(node)
            if target is None or META_KEY in node.meta:
                continue
            operands = linear_operands(node)
            experts = expert_operands(node) if operands is None else None
            if operands is not None:
                found = Annotation("linear", _linear_fqn(node, operands.weight), router=selects_experts(node))
            elif experts is not None:
                found = Annotation("experts", _linear_fqn(node, experts.weight))
            elif target in SOFTMAX:
                found = Annotation("softmax")
            elif target in RMS_NORM:
                found = Annotation("rms_norm")
            elif target in LAYER_NORM:
                found = Annotation("layer_norm")
            elif match_rms_variance(node) is not None:
                found = Annotation("rms_norm_variance")
            else:
                continue
            node.meta[META_KEY] = found
        # Annotations live in meta: the graph's code is unchanged, so nothing to recompile.
        return PassResult(gm, False)
