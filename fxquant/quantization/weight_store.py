"""The quantized copies of the model's weights that every compiled graph shares, and their refresh: one store per
process, owned here rather than by a pass.

- `shared_quantized`: one quantized copy of each model weight per recipe and layout. Dynamo compiles a model into
  several graphs (prefill and decode, a recompile, two compiled functions); each graph's quantize_linear asks here
  before quantizing. Entries live as long as the weight they quantize (a weak reference to the model's parameter)
  and are re-quantized in place, for every graph at once, when that weight changed. merge_linear may re-point their
  tensors into a stacked copy, which is then the one copy.
- `tiles_chosen` / `stored_layout`: 4-bit codes (weight-only, and W4A8's) are held in tiles (kernels/code_tiles.py)
  where the GPU's kernels read them, rather than in the rows `quantize` packs: the one copy, in the layout its readers
  want.
- `lanes_of` / `refresh_lanes`: the per-lane copies of 4-bit scales (and int4's zero points) that the mma.sync decode
  kernels read (pack_lanes), re-packed in place whenever their sources may have changed.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fxquant.config import LinearScheme, QuantConfig
from fxquant.kernels.cast import capability
from fxquant.kernels.code_tiles import tile_codes, tiles_fit
from fxquant.kernels.gemm_fp4_mma import pack_fp4_lanes
from fxquant.kernels.gemm_int4_mma import pack_lanes
from fxquant.numerics.quantized import Quantized

LANES_KEY = "fxquant_lanes"  # gm.meta: (scale buffer, zero point buffer or None, format) of each weight in lanes
WATCHED_KEY = "fxquant_lanes_follow"  # gm.meta: model parameters whose change re-packs gm's lanes (quantize_'s)

# parameter -> {(recipe, layout): (version, (Quantized, *what quantize measured with it))}
_ENTRIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared_quantized(owner: torch.Tensor | None, weight: torch.Tensor, recipe: str, layout: tuple,
                     quantize) -> tuple:
    """quantize(weight, recipe) -> (Quantized, *extras), computed once per (owner, recipe, layout) and owner
    version; owner None (a graph with no model behind it, as torch.export's) always quantizes afresh. `layout`
    names what sets the copy's layout (the weight read transposed, the codes in tiles), which quantize applies."""
    if owner is None:
        return quantize(weight, recipe)
    entries = _ENTRIES.setdefault(owner, {})
    found = entries.get((recipe, layout))
    if found is not None and found[0] == owner._version:
        return found[1]
    fresh = quantize(weight, recipe)
    if found is not None:  # same tensors, new values: graphs that hold them see the change
        with torch.no_grad():
            for old, new in zip(_tensors(found[1][0]), _tensors(fresh[0]), strict=True):
                old.copy_(new)
        fresh = (found[1][0], *fresh[1:])
    entries[(recipe, layout)] = (owner._version, fresh)
    return fresh


def tiles_chosen(config: QuantConfig, scheme: LinearScheme, weight: torch.Tensor) -> bool:
    """Whether an [N, K] weight's 4-bit codes are held in tiles: int4's (weight-only, and int4_fp8's W4A8 under
    int4_code_tiles=True), and MXFP4's and NVFP4's where their mma.sync kernel serves them (the option fp4_lanes). Under
    the option int4_code_tiles None (the default) where the GPU's kernels read them (CUDA, sm_80+), True wherever the
    shape tiles (the CPU's reference untiles them), False nowhere. W4A8's one-row GEMMs on the int4 kernel ran 14-21%
    faster alone over tiles than over rows (H100, BENCHMARKS.md, "W4A8 decode on the int4 kernel"); its 32-layer step
    over tiles is not yet timed (`bench.decode fxquant:int4_fp8 fxquant:int4_fp8+tiles`). In the 32-layer int4_wo step
    at one sequence the GPU took 3.130 ms over tiles against 3.432 over rows, and at 16 sequences 5.176 against 5.086,
    within the noise (H100, docs/decisions/0029-int4-codes-held-in-tiles-on-the-gpu.md); FP4 on its mma.sync kernel took
    2.146 ms over tiles against 2.530 over rows for 32 layers' MXFP4 GEMMs
    (docs/decisions/0031-fp4-decode-on-mma-sync.md)."""
    option = config.int4_code_tiles
    formats = ("int4", "mxfp4", "nvfp4") if config.fp4_lanes else ("int4",)
    w4a8 = scheme.kind == "int4_fp8"
    if option is False or (scheme.kind != "weight_only" and not w4a8) or scheme.weight_fmt not in formats:
        return False
    if weight.dim() != 2 or not tiles_fit(*weight.shape):
        return False
    # W4A8's tiles wait for the 32-layer step to time them: its kernels read them, by default its codes stay rows
    return option is True or (not w4a8 and weight.is_cuda and capability(weight.device) >= (8, 0))


def stored_layout(q: Quantized, tiled: bool) -> Quantized:
    """q as the backend holds it: its packed 4-bit codes in tiles where `tiled`, else as `quantize` packed them."""
    return dataclasses.replace(q, data=tile_codes(q.data)) if tiled else q


def _tensors(q: Quantized) -> list[torch.Tensor]:
    return [t for t in (q.data, q.scale, q.global_scale, q.zero_point, q.row_scale) if t is not None]


# The per-lane copy of each scale or zero point tensor, by where its values live: graphs of one model read the same
# storage through their own tensors (merge_linear builds a stacked buffer as a new view per graph). Held weakly, it
# lives as long as a graph holds it; that graph holds the source too, so the storage is not reused meanwhile.
_COPIES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _where(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _copy_of(source: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor | None:
    """The one copy of `source` in its kernel's layout, `packed` written into it afresh: the source may have been
    re-quantized in place since (by another graph's shared_quantized, or by the backend)."""
    found = None if source is None else _COPIES.get(_where(source))
    if found is None:
        if source is not None:
            _COPIES[_where(source)] = packed
        return packed
    with torch.no_grad():
        found.copy_(packed)
    return found


def lanes_of(scale: torch.Tensor, zero_point: torch.Tensor | None,
             fmt: str = "int4") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The per-lane copies of (scale, zero point) of a `fmt` weight (int4, mxfp4, nvfp4), one for every graph,
    packed afresh into them on each call."""
    lane_scale, lane_zero = pack_lanes(scale, zero_point) if fmt == "int4" else (pack_fp4_lanes(scale, fmt), None)
    return _copy_of(scale, lane_scale), _copy_of(zero_point, lane_zero)


def refresh_lanes(gm: torch.fx.GraphModule) -> None:
    """Re-pack the per-lane copies of gm's 4-bit weights, after the backend re-quantized some in place or a model
    parameter they follow (gm.meta[WATCHED_KEY]) changed."""
    for scale_name, zero_name, fmt in gm.meta.get(LANES_KEY, ()):
        lanes_of(getattr(gm, scale_name), getattr(gm, zero_name) if zero_name else None, fmt)
