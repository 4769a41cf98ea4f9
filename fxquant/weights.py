"""Every weight (parameter) a graph reads, once each, with the role that decides whether fxquant quantizes it:
the report's and the lint's account of all weight bytes, not only the linears'."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.passes.annotations import FQN_KEY, PARAMETER_KEY, annotation, fetch_attr, module_path, tensor_identity
from fxquant.passes.patterns import linear_operands
from fxquant.passes.spellings import CONVOLUTION, EMBEDDING, target_of

# role -> how the report names it; "linear" weights are accounted by their layer records instead
ROLES = {
    "linear": "linear weights",
    "quantized": "weights quantized before compile (quantize_)",
    "expert": "3-D expert weights (not quantized by fxquant yet)",
    "embedding": "embeddings (a gather, kept by design)",
    "norm_or_bias": "norm weights and biases",
    "other": "other weights",
}


@dataclass(frozen=True)
class WeightEntry:
    fqn: str
    shape: tuple[int, ...]
    nbytes: int
    role: str  # a key of ROLES
    used_by: str  # the module that reads it (for messages)


def _multiplies_by(user: torch.fx.Node, reads: list[torch.fx.Node]) -> bool:
    """Whether `user` is a linear whose weight operand is one of the get_attr nodes `reads`."""
    found = annotation(user)
    return found is not None and found.kind == "linear" and linear_operands(user).weight in reads


def _role(tensor: torch.Tensor, reads: list[torch.fx.Node]) -> str:
    users = [user for read in reads for user in read.users]
    targets = {target_of(user) for user in users}
    if any(_multiplies_by(user, reads) for user in users):
        return "linear"
    if any(str(target).startswith("fxquant.") for target in targets if target is not None):
        return "quantized"  # codes or scales an fxquant op reads: a QuantizedLinear's
    return weight_role(tensor, embedding=bool(targets & EMBEDDING), convolution=bool(targets & CONVOLUTION))


def weight_role(tensor: torch.Tensor, *, embedding: bool, convolution: bool = False) -> str:
    """The role of a weight no linear multiplies by, from its rank and what reads it."""
    if tensor.dim() >= 3 and not convolution:
        return "expert"  # [E, N, K] stacks of expert matrices, read by grouped / batched GEMMs or per expert
    if embedding:
        return "embedding"
    return "norm_or_bias" if tensor.dim() <= 1 else "other"


def weight_inventory(gm: torch.fx.GraphModule) -> list[WeightEntry]:
    """The graph's parameters, each tensor once (tied weights are one entry), in graph order."""
    found: dict[tuple, tuple[torch.Tensor, list[torch.fx.Node]]] = {}  # identity -> (tensor, its get_attr nodes)
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.meta.get(PARAMETER_KEY):
            continue
        tensor = fetch_attr(gm, node)
        if isinstance(tensor, torch.Tensor):
            found.setdefault(tensor_identity(tensor), (tensor, []))[1].append(node)
    entries = []
    for tensor, reads in found.values():
        fqn = reads[0].meta.get(FQN_KEY, reads[0].name)
        used_by = next((path for read in reads for user in read.users if (path := module_path(user))), fqn)
        entries.append(WeightEntry(fqn, tuple(tensor.shape), tensor.numel() * tensor.element_size(),
                                   _role(tensor, reads), used_by))
    return entries
