"""detect: annotate linear, rms_norm, layer_norm and softmax nodes, in every spelling dynamo and export use.

Pre:  any graph (torch-level from dynamo, aten-level from torch.export), after freeze_params.
Post: node.meta["fxquant"] = Annotation(kind, fqn) on each found node; the graph itself is unchanged.

Spellings: torch._C._nn.linear / F.linear / aten.linear.default; F.rms_norm / torch.rms_norm /
aten.rms_norm.default; F.layer_norm / aten.layer_norm.default; torch.softmax / F.softmax / Tensor.softmax /
aten._softmax / aten.softmax.int; and a hand-written RMSNorm's variance, x.pow(2).mean(-1, keepdim=True)
feeding rsqrt (transformers' LlamaRMSNorm), annotated on the pow node.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from fxquant.passes.annotations import (
    LAYER_NORM,
    LINEAR,
    META_KEY,
    RMS_NORM,
    SOFTMAX,
    Annotation,
    aten,
    target_of,
)
from fxquant.passes.freeze_params import FQN_KEY

POW = {torch.pow, torch.Tensor.pow, aten.pow.Tensor_Scalar}
MEAN = {torch.mean, torch.Tensor.mean, aten.mean.dim}
RSQRT = {torch.rsqrt, torch.Tensor.rsqrt, aten.rsqrt.default}
ADD = {torch.add, torch.Tensor.add, aten.add.Tensor, __import__("operator").add}


def _linear_fqn(node: torch.fx.Node) -> str | None:
    weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    fqn = weight.meta.get(FQN_KEY) if isinstance(weight, torch.fx.Node) else None
    return fqn[: -len(".weight")] if fqn and fqn.endswith(".weight") else fqn


def _is_rms_variance(pow_node: torch.fx.Node) -> bool:
    """pow(x, 2) -> mean(-1) -> [add eps] -> rsqrt."""
    if len(pow_node.args) < 2 or pow_node.args[1] != 2:
        return False
    for mean in pow_node.users:
        if target_of(mean) not in MEAN:
            continue
        frontier = list(mean.users)
        frontier += [u for n in frontier if target_of(n) in ADD for u in n.users]
        if any(target_of(n) in RSQRT for n in frontier):
            return True
    return False


class Detect(PassBase):
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        for node in gm.graph.nodes:
            target = target_of(node)
            if target is None or META_KEY in node.meta:
                continue
            if target in LINEAR:
                found = Annotation("linear", _linear_fqn(node))
            elif target in SOFTMAX:
                found = Annotation("softmax")
            elif target in RMS_NORM:
                found = Annotation("rms_norm")
            elif target in LAYER_NORM:
                found = Annotation("layer_norm")
            elif target in POW and _is_rms_variance(node):
                found = Annotation("rms_norm_variance")
            else:
                continue
            node.meta[META_KEY] = found
        # Annotations live in meta: the graph's code is unchanged, so nothing to recompile.
        return PassResult(gm, False)
