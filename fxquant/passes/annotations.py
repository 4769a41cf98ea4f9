"""What `detect` writes into node.meta and later passes read: frozen, so no pass edits another's findings."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

META_KEY = "fxquant"
aten = torch.ops.aten

LINEAR = {torch._C._nn.linear, F.linear, aten.linear.default}
SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, aten._softmax.default, aten.softmax.int}
RMS_NORM = {F.rms_norm, torch.rms_norm, aten.rms_norm.default}
LAYER_NORM = {F.layer_norm, torch.layer_norm, aten.layer_norm.default}
LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Annotation:
    kind: str  # "linear", "softmax", "rms_norm", "layer_norm", "rms_norm_variance" (hand-written x.pow(2).mean)
    fqn: str | None = None  # linear: the layer's fully qualified name


def annotation(node: torch.fx.Node) -> Annotation | None:
    return node.meta.get(META_KEY)


def target_of(node: torch.fx.Node):
    """The callable a node runs, with Tensor methods resolved (x.softmax -> torch.Tensor.softmax)."""
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, None)
    return node.target if node.op == "call_function" else None


def fake_value(node):
    """The example/fake tensor dynamo (example_value) or export/make_fx (val) recorded for a node."""
    if not isinstance(node, torch.fx.Node):
        return None
    return node.meta.get("val", node.meta.get("example_value"))


def node_dtype(node) -> torch.dtype | None:
    value = fake_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None
