"""Scale granularity: which elements share one scale, and the block view that makes that a last-dim reduce.

Spellings accepted everywhere: "tensor", "token" (one scale per row over the last dim), "channel" (one scale
per output row of an [N, K] weight), ("group", g) (g contiguous elements along the last dim) and
("block", bn, bk) (bn x bk tiles over the last two dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("tensor", "token", "channel", "group", "block")


@dataclass(frozen=True)
class Granularity:
    kind: str
    sizes: tuple[int, ...] = ()

    def __post_init__(self):
        want = {"tensor": 0, "token": 0, "channel": 0, "group": 1, "block": 2}
        if self.kind not in want:
            raise ValueError(f"fxquant: unknown granularity {self.kind!r}; valid: {', '.join(KINDS)}")
        if len(self.sizes) != want[self.kind] or any(int(s) <= 0 for s in self.sizes):
            raise ValueError(
                f"fxquant: granularity {self.kind!r} takes {want[self.kind]} positive size(s), got {self.sizes}; "
                "write ('group', 128) or ('block', 128, 128)"
            )

    def __str__(self) -> str:
        return self.kind if not self.sizes else f"{self.kind}{'x'.join(map(str, self.sizes))}"

    def check(self, shape: torch.Size | tuple[int, ...]) -> None:
        """Raise a clear error if `shape` cannot be cut into this granularity's blocks."""
        if self.kind in ("token", "group") and len(shape) < 1:
            raise ValueError(f"fxquant: {self.kind} granularity needs at least one dim, got a scalar")
        if self.kind == "channel" and len(shape) != 2:
            raise ValueError(
                f"fxquant: 'channel' granularity is for an [N, K] weight, got shape {tuple(shape)}; "
                "use 'token' for activations"
            )
        if self.kind == "group" and shape[-1] % self.sizes[0]:
            raise ValueError(
                f"fxquant: last dim {shape[-1]} is not a multiple of the group size {self.sizes[0]}; "
                "pad it, or pick 'token' granularity"
            )
        if self.kind == "block":
            if len(shape) < 2:
                raise ValueError(f"fxquant: block granularity needs 2 dims, got shape {tuple(shape)}")
            bn, bk = self.sizes
            if shape[-2] % bn or shape[-1] % bk:
                raise ValueError(
                    f"fxquant: shape {tuple(shape)} is not a multiple of the {bn}x{bk} block; "
                    "pad it, or pick 'channel' granularity"
                )

    def scale_shape(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        self.check(shape)
        shape = tuple(shape)
        if self.kind == "tensor":
            return ()
        if self.kind in ("token", "channel"):
            return shape[:-1] + (1,)
        if self.kind == "group":
            return shape[:-1] + (shape[-1] // self.sizes[0],)
        bn, bk = self.sizes
        return shape[:-2] + (shape[-2] // bn, shape[-1] // bk)

    def to_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """x: [*shape] -> [*scale_shape, elements per block]."""
        self.check(x.shape)
        if self.kind == "tensor":
            return x.reshape(-1)
        if self.kind in ("token", "channel"):
            return x.unsqueeze(-2)
        if self.kind == "group":
            g = self.sizes[0]
            return x.unflatten(-1, (x.shape[-1] // g, g))
        bn, bk = self.sizes
        tiles = x.unflatten(-1, (x.shape[-1] // bk, bk)).unflatten(-3, (x.shape[-2] // bn, bn))
        return tiles.transpose(-3, -2).flatten(-2)  # [..., M/bn, K/bk, bn*bk]

    def from_blocks(self, xb: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """Inverse of `to_blocks`."""
        if self.kind == "block":
            bn, bk = self.sizes
            return xb.unflatten(-1, (bn, bk)).transpose(-3, -2).reshape(shape)
        return xb.reshape(shape)


def as_granularity(g: Granularity | str | tuple) -> Granularity:
    if isinstance(g, Granularity):
        return g
    if isinstance(g, str):
        return Granularity(g)
    if isinstance(g, (tuple, list)) and g and isinstance(g[0], str):
        return Granularity(g[0], tuple(int(s) for s in g[1:]))
    raise ValueError(
        f"fxquant: cannot read granularity {g!r}; write one of 'tensor', 'token', 'channel', "
        "('group', g), ('block', bn, bk)"
    )


def activation_granularity(group_size: int) -> Granularity:
    """The fp8 activation scales that one integer names, as the recipes (`LinearScheme.act_group`) and the ops
    (`quantize_fp8`'s group_size) pass it: 0 per token, -1 per tensor, else 1 x group_size groups."""
    if group_size < 0:
        return Granularity("tensor")
    return Granularity("token") if group_size == 0 else Granularity("group", (group_size,))
