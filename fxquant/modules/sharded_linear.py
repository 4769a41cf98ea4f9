"""`quantize_` on tensor-parallel linears: a DTensor weight is quantized shard by shard, and the `QuantizedLinear`
that replaces it holds DTensor codes and scales whose local tensors are this rank's quantized shard.

    ColwiseParallel (W Shard(0), bias Shard(0)): every part Shard(0); each rank's rows keep their own scales, as
        the unsharded weight's per-row and 128-row-block scales would be.
    RowwiseParallel (W Shard(1), no bias): every part Shard(1). Group and block scales along K are the unsharded
        weight's where the shard boundary falls on a group; a per-row scale becomes one per (row, shard) ([N, 1]
        locally, [N, world] as a DTensor), as the backend's compile of the same sharded model quantizes it.

The forward runs fxquant's ops on the local tensors and gives DTensor the output it would have computed: Shard(-1)
for column parallel, Partial() (summed by the parallel style's output hook) for row parallel. The parallel style's
input and output hooks move with the layer. Left as they are, with `LAYOUT_REASON`: other placements, meshes of
more than one dimension, uneven shards, a row-parallel bias (it must be added once, after the sum), and per-tensor
weight scales (fp8_tensor's, NVFP4's global scale), which would differ per shard.

`gathered` all-gathers a sharded layer into the whole one, for `save_quantized`: the checkpoint a sharded model
writes is the unsharded model's wherever the shards' scales are the unsharded weight's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Shard

from fxquant.config import RECIPES
from fxquant.quantization.linear_ops import emit_linear, run_now

SHARDED_LAYOUTS = ("column parallel (weight and bias Shard(0)) and row parallel without bias (weight Shard(1)) on a "
                   "1-D mesh, in even shards, under recipes without a per-tensor weight scale (not fp8_tensor or "
                   "nvfp4_wo: it would differ per shard)")
LAYOUT_REASON = f"a DTensor (tensor-parallel) weight in a layout quantize_ does not shard: it takes {SHARDED_LAYOUTS}"


def shard_dim(weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> int | None:
    """The weight's shard dim (0: column parallel, 1: row parallel) where quantize_ shards it, else None."""
    scheme = RECIPES[recipe]
    if not isinstance(weight, DTensor) or weight.device_mesh.ndim != 1 or scheme.weight_fmt == "nvfp4" \
            or scheme.weight_granularity == "tensor":
        return None
    placement = weight.placements[0]
    dim = placement.dim % 2 if isinstance(placement, Shard) else None
    if dim is None or weight.shape[dim] % weight.device_mesh.size():
        return None  # uneven shards: from_local's global shape would not be the weight's
    if dim == 0 and (bias is None or (isinstance(bias, DTensor) and bias.placements[0] == Shard(0))):
        return 0
    return 1 if dim == 1 and bias is None else None


def sharded_parts(parts: dict, weight: DTensor, dim: int) -> dict:
    """This rank's quantized parts as DTensors on the weight's mesh, sharded along `dim`."""
    wrap = lambda t: DTensor.from_local(t, weight.device_mesh, (Shard(dim),), run_check=False)
    return {name: None if t is None else wrap(t) for name, t in parts.items()}


def move_hooks(old: nn.Module, new: nn.Module) -> None:
    """The parallel style's input and output hooks (and any others) from the replaced layer to its replacement."""
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
                 "_forward_hooks_always_called"):
        getattr(new, attr).update(getattr(old, attr))


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


def sharded_forward(layer, x: torch.Tensor) -> DTensor:
    """The layer's product on local shards, as the DTensor linear(x, W, b) would give it."""
    consts = tuple(local(getattr(layer, name)) for name in layer.part_names())
    x_local = local(x)
    out = emit_linear(run_now, RECIPES[layer.recipe], x_local, consts, local(layer.bias), consts[0].shape[0],
                      x_local.dtype)
    placement = Shard(-1) if layer.weight.placements[0] == Shard(0) else Partial()
    return DTensor.from_local(out, layer.weight.device_mesh, (placement,), run_check=False)


def gathered(layer, name: str):
    """The whole layer of a tensor-parallel QuantizedLinear, its parts all-gathered (every rank must call it);
    `layer` itself where it is not sharded. A row-parallel layer's per-channel weight scales ([N, world] in all)
    become the checkpoint's one per row where the shards share them (a model load_quantized sharded); where they
    differ (quantize_ on the shards), it raises, naming the layer and the fix."""
    if not isinstance(layer.weight, DTensor):
        return layer
    parts = {part: whole(getattr(layer, part)) for part in layer.part_names()}
    if layer.weight.placements[0] == Shard(1) and RECIPES[layer.recipe].weight_granularity == "channel":
        scales = parts["weight_scale"]
        if not torch.equal(scales, scales[:, :1].expand_as(scales)):
            raise ValueError(f"fxquant: {name} is row parallel under {layer.recipe}: each rank's shard has its own "
                             "per-channel weight scale, which a checkpoint's one scale per row cannot hold. Fix: "
                             "save_quantized the model quantized before sharding, or quantize with a recipe whose "
                             "scales follow K's groups or blocks (int4_wo, fp8_block, mxfp4_wo)")
        parts["weight_scale"] = scales[:, :1].contiguous()
    return type(layer)(layer.in_features, layer.out_features, layer.recipe, parts, whole(layer.bias))


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor all-gathered; fp8 codes travel as their bytes, which gloo (and older NCCL) can gather."""
    if not isinstance(t, DTensor):
        return t
    if t.dtype.itemsize != 1 or t.dtype in (torch.int8, torch.uint8):
        return t.full_tensor()
    as_bytes = DTensor.from_local(t.to_local().view(torch.uint8), t.device_mesh, t.placements, run_check=False)
    return as_bytes.full_tensor().view(t.dtype)
