"""compressed-tensors' `kv_cache_scheme`: a static fp8 scale per tensor for each attention layer's K and V, stored
as `<attention module>.k_scale` / `.v_scale` (the names llm-compressor writes and vLLM reads)."""

from __future__ import annotations

import re

import torch
import torch.nn as nn

# e4m3 values, one scale per tensor, fixed ahead of time: what FP8StaticCache(kv_scales=...) computes
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
KEYS = ("k_scale", "v_scale")


def attention_modules(model: nn.Module) -> list[str]:
    """The attention modules of a transformers decoder in layer order: those with an int layer_idx and a k_proj."""
    found = [(module.layer_idx, name) for name, module in model.named_modules()
             if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "k_proj")]
    return [name for _, name in sorted(found)]


def scale_tensors(model: nn.Module, kv_scales) -> dict[str, torch.Tensor]:
    """The checkpoint's k_scale / v_scale tensors (fp32, one element each) for one (k, v) pair per layer."""
    names = attention_modules(model)
    if len(kv_scales) != len(names):
        raise ValueError(f"fxquant: {len(kv_scales)} kv_scales pairs for the {len(names)} attention layers of "
                         f"{type(model).__name__}; give one (k_scale, v_scale) per layer, as kv_scales_of returns")
    return {f"{name}.{key}": torch.tensor([float(scale)], dtype=torch.float32)
            for name, pair in zip(names, kv_scales, strict=True) for key, scale in zip(KEYS, pair, strict=True)}


def is_scale_key(key: str) -> bool:
    return key.rpartition(".")[2] in KEYS


def pairs_from(tensors: dict[str, torch.Tensor]) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer from a checkpoint's scale tensors, ordered by the layer index in their names."""
    layer = lambda name: [int(n) for n in re.findall(r"\.(\d+)\.", f".{name}.")]
    modules = sorted({key.rpartition(".")[0] for key in tensors if is_scale_key(key)}, key=layer)
    missing = [f"{m}.{k}" for m in modules for k in KEYS if f"{m}.{k}" not in tensors]
    if missing:
        raise ValueError(f"fxquant: the checkpoint's kv_cache_scheme lacks {missing[:4]}")
    return [tuple(float(tensors[f"{m}.{k}"].float().reshape(())) for k in KEYS) for m in modules]
