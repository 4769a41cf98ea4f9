"""localize_shards: a tensor-parallel linear over DTensors becomes the same linear over this rank's shards, so the
passes after it quantize each rank's shard of the weight as a plain weight, once, and run fxquant's GEMMs on local
tensors. DTensor keeps the collectives: its redistribute and to_local after the linear stay as they are.

Pre: freeze_params ran (a DTensor weight is a get_attr). DTensor's parallel styles wrap each linear's input:

    ColwiseParallel: W Shard(0), bias Shard(0)             RowwiseParallel: W Shard(1), no bias
    %x_d = from_local(%x, mesh, (Replicate(),))            %x_d = from_local(%x, mesh, (Shard(-1),))
    %y_d = linear(%x_d, W_d, b_d)   (Shard(-1))            %y_d = linear(%x_d, W_d)   (Partial(): summed later)

Post:

    %y = linear(%x, W_local, b_local)                      %y = linear(%x, W_local)
    %y_d = from_local(%y, mesh, (Shard(-1),))              %y_d = from_local(%y, mesh, (Partial(),))

The local weight's get_attr keeps the layer's name, so the report and the options (skip, include, layer_recipes)
name the layer as in the unsharded model. Left as they are, and reported as sharded by the quantize pass: any
other placement, a mesh of more than one dimension, and a row-parallel bias, which must be added once, after the
sum.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.fx.passes.infra.pass_base import PassResult

from fxquant.passes.annotations import SHARD_KEY, SOURCE_KEY, fake_value, fetch_attr
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import linear_operands


def _wrapped_local(node) -> torch.fx.Node | None:
    """The local tensor where node is DTensor.from_local(local, mesh, placements), else None. The mesh and
    placements are read from the node's DTensor value: torch 2.11's dynamo records the call as a closure holding
    them, later versions as from_local with arguments."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or not node.args:
        return None
    if "from_local" not in getattr(node.target, "__qualname__", "") or not isinstance(fake_value(node), DTensor):
        return None
    return node.args[0]


def rewrapped_as(mesh, placements):
    """DTensor.from_local for this mesh and placements, as a graph's call_function target of one argument."""
    def from_local(local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local, mesh, placements, run_check=False)  # every rank's shard is as computed
    return from_local


def _shard_dim(placement, ndim: int) -> int | None:
    return placement.dim % ndim if isinstance(placement, Shard) else None


def local_layout(x: DTensor, w: DTensor, bias) -> tuple | None:
    """The output placement of linear(x, w, bias) computed on local shards, or None where it is not one."""
    if x.device_mesh.ndim != 1 or w.device_mesh.ndim != 1:
        return None
    x_placement = x.placements[0]
    w_dim = _shard_dim(w.placements[0], 2)
    if isinstance(x_placement, Replicate) and w_dim == 0:  # column parallel: each rank owns N / world outputs
        if bias is not None and not (isinstance(bias, DTensor) and _shard_dim(bias.placements[0], 1) == 0):
            return None
        return (Shard(-1),)
    if _shard_dim(x_placement, x.dim()) == x.dim() - 1 and w_dim == 1 and bias is None:
        return (Partial(),)  # row parallel: each rank's K slice gives a partial sum
    return None


class LocalizeShards(FxquantPass):
    name = "localize_shards"
    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        modified = False
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and self._localize(gm, node):
                modified = True
        return PassResult(gm, modified)

    def _localize(self, gm: torch.fx.GraphModule, linear: torch.fx.Node) -> bool:
        operands = linear_operands(linear)
        if operands is None or operands.transposed or operands.cast:
            return False
        x_local = _wrapped_local(operands.x)
        w = fetch_attr(gm, operands.weight)
        bias = fetch_attr(gm, operands.bias) if isinstance(operands.bias, torch.fx.Node) else None
        if x_local is None or not isinstance(w, DTensor):
            return False
        if isinstance(operands.bias, torch.fx.Node) and not isinstance(bias, DTensor):
            return False
        out_placements = local_layout(fake_value(operands.x), w, bias)
        out = fake_value(linear)
        if out_placements is None or not isinstance(out, DTensor):
            return False
        if out_placements[0] != Partial() and out._local_tensor.shape[-1] * w.device_mesh.size() != out.shape[-1]:
            return False  # an uneven column split: from_local, given no global shape, assumes even shards
        graph = linear.graph
        with graph.inserting_before(linear):
            local_w = _local_constant(gm, operands.weight, w)
            local_b = _local_constant(gm, operands.bias, bias) if bias is not None else None
            local = graph.call_function(torch.nn.functional.linear, (x_local, local_w, local_b))
            local.meta.update({k: v for k, v in linear.meta.items() if k not in ("val", "example_value")})
            local.meta["example_value"] = out._local_tensor
            rewrapped = graph.call_function(rewrapped_as(w.device_mesh, out_placements), (local,))
            rewrapped.meta.update(linear.meta)
        linear.replace_all_uses_with(rewrapped)
        graph.erase_node(linear)
        for constant in (operands.weight, operands.bias):  # the DTensor's get_attr, unread now (other nodes untouched)
            if isinstance(constant, torch.fx.Node) and not constant.users:
                graph.erase_node(constant)
        return True


def _local_constant(gm: torch.fx.GraphModule, node: torch.fx.Node, value: DTensor) -> torch.fx.Node:
    """A get_attr of this rank's shard of a DTensor constant, with the constant's name and marks (FQN_KEY,
    PARAMETER_KEY), and SHARD_KEY."""
    attr = f"{node.target}_local"
    if not hasattr(gm, attr):
        gm.register_buffer(attr, value._local_tensor)
    const = gm.graph.get_attr(attr)
    const.meta.update({k: v for k, v in node.meta.items() if k not in ("val", "example_value")})
    const.meta["example_value"] = fake_value(node)._local_tensor
    # The shard is the parameter's storage: an in-place update (load_state_dict) bumps its version, and
    # re-quantization reads the shard, never the whole weight.
    const.meta[SOURCE_KEY] = value._local_tensor if node.meta.get(SOURCE_KEY) is not None else None
    const.meta[SHARD_KEY] = tuple(value.shape)
    return const
