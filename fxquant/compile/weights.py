"""Every weight (parameter) a graph reads, once each, with the role that decides whether fxquant quantizes it:
the report's and the lint's account of all weight bytes, not only the linears'."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxquant.passes.annotations import FQN_KEY, PARAMETER_KEY, annotation, fetch_attr, module_path, tensor_identity
from fxquant.passes.patterns import weight_operands
from fxquant.passes.spellings import (
    BMM,
    CASTS,
    CONVOLUTION,
    EMBEDDING,
    EXPAND,
    GATHER_ROWS,
    GROUPED_MM,
    MATMUL,
    PERMUTE,
    RESHAPE,
    SWAP_2D,
    TRANSPOSE,
    UNSQUEEZE,
    target_of,
)

# A 3-D weight is an expert stack where a batched product reads it through views and indexing alone (W[ids], W.mT):
# a position embedding or a CLS token reaches products too, but only after an add to activations.
PRODUCTS = BMM | GROUPED_MM | MATMUL | {torch.einsum}
VIEWS = TRANSPOSE | PERMUTE | SWAP_2D | UNSQUEEZE | EXPAND | RESHAPE | GATHER_ROWS | CASTS | {getattr}
VIEW_HOPS = 4

# role -> how the report names it; "linear" weights (of linears and of the expert products fxquant finds) are
# accounted by their layer records instead
ROLES = {
    "linear": "linear weights",
    "quantized": "weights quantized before compile (quantize_)",
    "expert": "3-D expert weights in no expert product fxquant recognises",
    "tensor": "other 3-D and larger weights (position embeddings, class tokens)",
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


def _multiplied(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The get_attr nodes that a detected linear or expert product takes as its weight."""
    found = set()
    for node in gm.graph.nodes:
        kind = getattr(annotation(node), "kind", None)
        if kind in ("linear", "experts"):
            found.add(weight_operands(node).weight)
    return found


def _read_by_product(reads: list[torch.fx.Node]) -> bool:
    """Whether a batched matrix product takes the weight as an operand, through views and indexing only."""
    frontier = reads
    for _ in range(VIEW_HOPS):
        users = [user for node in frontier for user in node.users]
        if any(target_of(user) in PRODUCTS for user in users):
            return True
        frontier = [user for user in users if target_of(user) in VIEWS]
    return False


def _role(tensor: torch.Tensor, reads: list[torch.fx.Node], multiplied: set[torch.fx.Node]) -> str:
    users = [user for read in reads for user in read.users]
    targets = {target_of(user) for user in users}
    if any(read in multiplied for read in reads):
        return "linear"
    if any(str(target).startswith("fxquant.") for target in targets if target is not None):
        return "quantized"  # codes or scales an fxquant op reads: a QuantizedLinear's
    return weight_role(tensor, embedding=bool(targets & EMBEDDING), convolution=bool(targets & CONVOLUTION),
                       product=tensor.dim() >= 3 and _read_by_product(reads))


def weight_role(tensor: torch.Tensor, *, embedding: bool, convolution: bool = False, product: bool = False) -> str:
    """The role of a weight no linear multiplies by, from its rank and what reads it. product: a batched matrix
    product reads it (a stack of expert matrices [E, N, K])."""
    if tensor.dim() >= 3 and not convolution:
        return "expert" if product else "tensor"
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
    entries, multiplied = [], _multiplied(gm)
    for tensor, reads in found.values():
        fqn = reads[0].meta.get(FQN_KEY, reads[0].name)
        used_by = next((path for read in reads for user in read.users if (path := module_path(user))), fqn)
        entries.append(WeightEntry(fqn, tuple(tensor.shape), tensor.numel() * tensor.element_size(),
                                   _role(tensor, reads, multiplied), used_by))
    return entries
