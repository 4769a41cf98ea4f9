"""Every weight (parameter) a graph reads, once each, with the role that decides whether fxquant quantizes it:
the report's and the lint's account of all weight bytes, not only the linears'."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.passes.annotations import FQN_KEY, PARAMETER_KEY, annotation, fetch_attr, module_path, tensor_identity
from fxquant.passes.spellings import CONVOLUTION, EMBEDDING, target_of

# role -> how the report names it; "linear" weights are accounted by their layer records instead
ROLES = {
    "linear": "linear weights",
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


def _role(tensor: torch.Tensor, users: list[torch.fx.Node]) -> str:
    targets = {target_of(user) for user in users}
    if any((found := annotation(user)) is not None and found.kind == "linear" for user in users):
        return "linear"
    if tensor.dim() >= 3 and not targets & CONVOLUTION:
        return "expert"  # [E, N, K] stacks of expert matrices, read by grouped / batched GEMMs or per expert
    if targets & EMBEDDING:
        return "embedding"
    return "norm_or_bias" if tensor.dim() <= 1 else "other"


def weight_inventory(gm: torch.fx.GraphModule) -> list[WeightEntry]:
    """The graph's parameters, each tensor once (tied weights are one entry), in graph order."""
    found: dict[tuple, tuple[torch.fx.Node, torch.Tensor, list[torch.fx.Node]]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not node.meta.get(PARAMETER_KEY):
            continue
        tensor = fetch_attr(gm, node)
        if not isinstance(tensor, torch.Tensor):
            continue
        first = found.setdefault(tensor_identity(tensor), (node, tensor, []))
        first[2].extend(node.users)
    entries = []
    for node, tensor, users in found.values():
        used_by = next((path for user in users if (path := module_path(user))), node.meta.get(FQN_KEY, node.name))
        entries.append(WeightEntry(node.meta.get(FQN_KEY, node.name), tuple(tensor.shape),
                                   tensor.numel() * tensor.element_size(), _role(tensor, users), used_by))
    return entries
