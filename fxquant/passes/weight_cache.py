"""One quantized copy of each model weight, shared by every graph compiled from that model.

Dynamo compiles a model into several graphs (prefill and decode, a recompile, two compiled functions); each
graph's quantize_linear asks here before quantizing. Entries live as long as the weight they quantize (a weak
reference to the model's parameter) and are re-quantized in place, for every graph at once, when that weight
changed. merge_linear may re-point their tensors into a stacked copy, which is then the one copy.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fxquant.quantized import Quantized

# parameter -> {(recipe, transposed): (version, (Quantized, *what quantize measured with it))}
_ENTRIES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def shared_quantized(owner: torch.Tensor | None, weight: torch.Tensor, recipe: str, transposed: bool,
                     quantize) -> tuple:
    """quantize(weight, recipe) -> (Quantized, *extras), computed once per (owner, recipe, layout) and owner
    version; owner None (a graph with no model behind it, as torch.export's) always quantizes afresh."""
    if owner is None:
        return quantize(weight, recipe)
    entries = _ENTRIES.setdefault(owner, {})
    found = entries.get((recipe, transposed))
    if found is not None and found[0] == owner._version:
        return found[1]
    fresh = quantize(weight, recipe)
    if found is not None:  # same tensors, new values: graphs that hold them see the change
        with torch.no_grad():
            for old, new in zip(_tensors(found[1][0]), _tensors(fresh[0]), strict=True):
                old.copy_(new)
        fresh = (found[1][0], *fresh[1:])
    entries[(recipe, transposed)] = (owner._version, fresh)
    return fresh


def _tensors(q: Quantized) -> list[torch.Tensor]:
    return [t for t in (q.data, q.scale, q.global_scale, q.zero_point) if t is not None]
