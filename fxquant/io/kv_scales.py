"""`fxquant.kv_scales_of`: the static scales of an FP8 KV cache, measured on a filled cache or read from a
checkpoint."""

from __future__ import annotations

import os

from transformers.cache_utils import StaticCache

from fxquant.io.checkpoint import stored_kv_scales
from fxquant.modules.kv_cache import measured_kv_scales


def kv_scales_of(source: StaticCache | str | os.PathLike) -> list[tuple[float, float]]:
    """Static per-tensor scales, one (k_scale, v_scale) per layer: from a high-precision StaticCache filled by
    calibration prompts (each layer's K and V amax / 448, so that nothing the prompts wrote would saturate), or
    from a checkpoint folder's kv_cache_scheme (save_quantized(..., kv_scales=...), or llm-compressor's)."""
    if isinstance(source, str | os.PathLike):
        return stored_kv_scales(source)
    return measured_kv_scales(source)
