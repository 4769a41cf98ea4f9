"""What `detect` writes into node.meta and later passes read (frozen, so no pass edits another's findings), and the
graph helpers every pass shares."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

META_KEY = "fxquant"
FQN_KEY = "fxquant_fqn"  # on get_attr nodes: the constant's fully qualified name in the user's model
PARAMETER_KEY = "fxquant_parameter"  # on get_attr nodes: True for the model's parameters (weights), not buffers
SOURCE_KEY = "fxquant_source"  # on get_attr nodes freeze_params made: the model's nn.Parameter itself
PARTS_KEY = "fxquant_parts"  # on get_attr nodes merge_linear stacked from shared tensors: those tensors, in order
SHARD_KEY = "fxquant_shard"  # on get_attr nodes localize_shards made: the whole (DTensor) weight's shape


@dataclass(frozen=True)
class Annotation:
    # "linear", "experts" (an MoE layer's expert product), "softmax", "rms_norm", "layer_norm",
    # "rms_norm_variance" (hand-written x.pow(2).mean)
    kind: str
    fqn: str | None = None  # linear, experts: the layer's fully qualified name
    router: bool = False  # linear: its output selects experts (feeds a top-k)


def annotation(node: torch.fx.Node) -> Annotation | None:
    return node.meta.get(META_KEY)


def fake_value(node):
    """The example/fake tensor dynamo (example_value) or export/make_fx (val) recorded for a node."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def node_dtype(node) -> torch.dtype | None:
    value = fake_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def fetch_attr(gm, node):
    """The tensor a get_attr node reads, or None for any other node."""
    if gm is None or not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    value = gm
    for part in node.target.split("."):
        value = getattr(value, part)
    return value


def tensor_identity(t: torch.Tensor):
    """Equal for two get_attr tensors that are one weight (a tied lm_head and embedding share one storage). A
    DTensor, which has no storage of its own, is known by its local shard's."""
    local = getattr(t, "_local_tensor", t)
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def module_path(node: torch.fx.Node) -> str | None:
    """The innermost module that ran `node`, as a name in the user's model (L['self'].layers[0].norm ->
    layers.0.norm; export's L__self__... paths come already dotted), or None where nothing recorded it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['\w+'\](\[\d+\])?\.?", "", path)  # the local holding the model: L['self'], L['args'][0]
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path)


def linear_fqn(node: torch.fx.Node) -> str:
    """A linear layer's name: its annotation's, else the node's."""
    found = annotation(node)
    return (found.fqn if found is not None else None) or node.name


def place_name(node: torch.fx.Node) -> str:
    """Where a node sits in the user's model, for messages: its module path and what it computes."""
    path = module_path(node)
    return f"{path} ({node.name})" if path else node.name
