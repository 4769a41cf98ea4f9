"""`load_quantized` into a tensor-parallel skeleton: a model built under `empty_weights()` and sharded with DTensor's
parallel styles before it is filled. Each rank reads its own slice of every sharded tensor (a safetensors slice,
never the whole tensor), and a sharded quantized linear becomes the QuantizedLinear that `quantize_` gives the same
shard: DTensor codes and scales (`sharded_linear`), with its parallel style's hooks.

A rank's slice of a layer's stored tensor follows from the stored layout. The tensors compressed-tensors stores for
the rank's [rows, cols] shard have the whole layer's shape divided by the ranks along one axis (codes, group and
block scales, int4's zero points packed down the rows), or its very shape: a row-parallel layer's per-channel scale,
which each rank reads whole, since every slice of K is dequantized by the same row scale.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from fxquant.config import RECIPES
from fxquant.io.compressed_tensors import to_checkpoint
from fxquant.modules.quantized_linear import QuantizedLinear
from fxquant.modules.sharded_linear import SHARDED_LAYOUTS, shard_dim, sharded_parts
from fxquant.quantization.weight_quantization import alignment_reason


@dataclass(frozen=True)
class ShardedLayer:
    """A quantized linear of the checkpoint whose skeleton weight is this rank's shard (`dim` as `shard_dim`)."""

    name: str
    weight: DTensor
    dim: int
    recipe: str

    @property
    def world(self) -> int:
        return self.weight.device_mesh.size()

    @property
    def shape(self) -> tuple[int, int]:
        """[rows, cols] of this rank's shard."""
        rows, cols = self.weight.shape
        return (rows // self.world, cols) if self.dim == 0 else (rows, cols // self.world)

    def read(self, handle, key: str) -> torch.Tensor:
        """This rank's slice of the layer's stored tensor `key`, read alone."""
        stored = tuple(handle.get_slice(key).get_shape())
        local = _stored_shapes(self.recipe, *self.shape).get(key.rpartition(".")[2])
        if local is None or local == stored:
            return handle.get_tensor(key)  # not sharded: weight_shape, a row-parallel per-channel scale
        axes = [a for a in range(len(stored)) if stored[a] != local[a]]
        if len(stored) != len(local) or len(axes) != 1 or stored[axes[0]] != self.world * local[axes[0]]:
            raise ValueError(f"fxquant: checkpoint tensor {key} is {stored}, which does not split into {self.world} "
                             f"shards of {local} for {self.name}'s [rows, cols] = {list(self.shape)} on this rank. "
                             "Fix: build the skeleton from the checkpoint's own config.json")
        return _slice(handle, key, axes[0], self.weight.device_mesh.get_local_rank() * local[axes[0]],
                      local[axes[0]], len(stored))

    def parameters(self, parts: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
        """The rank's parts (as from_checkpoint gives them) as the layer's DTensor parameters."""
        return {key: nn.Parameter(t, requires_grad=False)
                for key, t in sharded_parts(parts, self.weight, self.dim).items() if t is not None}


def sharded_layer(name: str, module: nn.Module, weight: DTensor, recipe: str) -> ShardedLayer:
    """The ShardedLayer for a skeleton linear whose weight is a DTensor; an error naming the layer and the fix where
    its shards cannot hold the checkpoint's codes and scales."""
    dim = shard_dim(weight, module.bias, recipe)
    if dim is None:
        raise ValueError(f"fxquant: {name} is {recipe}, {weight.placements} on a {weight.device_mesh.ndim}-D mesh, "
                         f"which load_quantized does not shard: it takes {SHARDED_LAYOUTS}. Fix: shard {name} with "
                         "ColwiseParallel or RowwiseParallel on a 1-D mesh, or leave it out of the parallel plan")
    layer = ShardedLayer(name, weight, dim, recipe)
    reason = alignment_reason(layer.shape, RECIPES[recipe])
    if reason:
        raise ValueError(f"fxquant: {name}'s shard on each of {layer.world} ranks is {list(layer.shape)}, which splits "
                         f"the {recipe} checkpoint's groups or blocks ({reason}). Fix: shard over fewer ranks, or "
                         f"leave {name} out of the parallel plan")
    return layer


def read_parameter(handle, key: str, current: torch.Tensor | None) -> torch.Tensor:
    """Checkpoint tensor `key` for the skeleton's `current`: where that is a DTensor, this rank's slice of it (as a
    DTensor with the same placement), read alone; else the whole tensor."""
    if not isinstance(current, DTensor):
        return handle.get_tensor(key)
    mesh, placements = current.device_mesh, current.placements
    stored = tuple(handle.get_slice(key).get_shape())
    if mesh.ndim != 1 or not isinstance(placements[0], Shard | Replicate) or stored != tuple(current.shape):
        raise ValueError(f"fxquant: checkpoint tensor {key} is {stored}, its skeleton's a DTensor "
                         f"{tuple(current.shape)} {placements} on a {mesh.ndim}-D mesh; load_quantized reads tensors "
                         "sharded on a 1-D mesh "
                         "(Shard or Replicate) of the stored shape. Fix: build the skeleton from the checkpoint's "
                         "config.json and shard it on a 1-D mesh")
    if isinstance(placements[0], Replicate):
        return DTensor.from_local(handle.get_tensor(key), mesh, placements, run_check=False)
    dim = placements[0].dim % len(stored)
    chunk = -(-stored[dim] // mesh.size())  # DTensor's Shard splits as torch.chunk does: ceil-sized chunks
    start = min(mesh.get_local_rank() * chunk, stored[dim])
    local = _slice(handle, key, dim, start, min(chunk, stored[dim] - start), len(stored))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=current.shape, stride=current.stride())


def _slice(handle, key: str, axis: int, start: int, size: int, dims: int) -> torch.Tensor:
    index = tuple(slice(start, start + size) if a == axis else slice(None) for a in range(dims))
    return handle.get_slice(key)[index]


@functools.cache
def _stored_shapes(recipe: str, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
    """Shape of each tensor compressed-tensors stores for a `recipe` layer of [rows, cols]."""
    empty = QuantizedLinear.empty(cols, rows, recipe, bias=False, dtype=torch.bfloat16, device="meta")
    return {key: tuple(t.shape) for key, t in to_checkpoint(empty, recipe).items()}
