"""An FP8 KV cache: transformers' `StaticCache` whose layers store e4m3 codes and fp32 scales.

    cache = fxquant.FP8StaticCache(config=model.config, max_cache_len=4096)   # StaticCache's constructor
    model.generate(ids, past_key_values=cache, ...)                            # or a manual decode loop

- A write quantizes each new K and V: per (token, KV head) with a scale from that row's amax (the default: no
  calibration, and no value is ever clipped), or per tensor with static scales (`kv_scales`, one (k, v) pair per
  layer, as vLLM's k_scale / v_scale; `fxquant.kv_scales_of` measures them on a filled bf16 cache). A static scale
  saturates a value past 448 x scale to +-448 x scale, as vLLM's does.
- A read returns `fxquant::dequantize_kv(codes, scale)`. Compiled with `backend="fxquant"` on CUDA, the decode pass
  hands the codes and scales to `fxquant::decode_attention`, which dequantizes in registers, so no high-precision
  copy of the cache is made. Elsewhere (eager, prefill, the CPU) each layer's read makes one, freed after its
  attention.
- Layers of every kind transformers' StaticCache holds for attention, full and sliding, store codes: each keeps
  transformers' own update (the write position, the sliding window's roll) and runs it on the codes. The scales live
  in a twin layer of the same kind: a full layer writes them at its codes' positions, a sliding one runs the twin's
  own update. Layer kinds of other caches (linear attention, indexed) are refused.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.numerics.formats import E4M3
from fxquant.numerics.reference import saturate, scale_from_amax

CODES = torch.float8_e4m3fn
# Called by overload, so that graphs record the overload the passes match (a packet call records the packet).
QUANTIZE, DEQUANTIZE_KV = torch.ops.fxquant.quantize_fp8.default, torch.ops.fxquant.dequantize_kv.default


class _E4M3Codes:
    """Placed before a transformers cache layer class: its keys and values hold e4m3 codes (stored as uint8, which
    every device's index_copy_ and roll serve) and `scales` holds their fp32 scales, or `static_scales` one
    (k, v) pair for the whole layer."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states, value_states: [B, Hkv, Q, D], the new positions
        if self.static_scales is None:
            k_codes, k_scale = QUANTIZE(key_states, 0)  # per (token, KV head): [..., Q, 1]
            v_codes, v_scale = QUANTIZE(value_states, 0)
            k_scale, v_scale = self._write_scales(k_scale, v_scale, *args, **kwargs)
            k_scale, v_scale = k_scale[..., 0], v_scale[..., 0]  # [B, Hkv, S]
        else:
            k_scale, v_scale = (torch.full((1,), s, dtype=torch.float32, device=key_states.device)
                                for s in self.static_scales)
            k_codes, v_codes = _static_codes(key_states, k_scale), _static_codes(value_states, v_scale)
        keys, values = super().update(k_codes.view(torch.uint8), v_codes.view(torch.uint8), *args, **kwargs)
        return (DEQUANTIZE_KV(keys.view(CODES), k_scale, key_states.dtype),
                DEQUANTIZE_KV(values.view(CODES), v_scale, key_states.dtype))

    def _write_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor, *args, **kwargs):
        """The scales written where this update writes the codes; returns the twin's (keys, values). A full layer
        writes its codes at arange(n) + cumulative_length, which the scales take before the codes' update advances
        it: one count a layer, which a compiled step computes once (the twin's own count cost a GPU kernel a layer).
        A sliding layer, whose update rolls, runs its twin's update."""
        twin = self.scales
        if not isinstance(self, StaticSlidingWindowLayer) and isinstance(self.cumulative_length, torch.Tensor):
            if not twin.is_initialized:
                twin.lazy_initialization(k_scale, v_scale)
            # (the count is still on the host before the codes' first update places it)
            positions = torch.arange(k_scale.shape[-2], device=k_scale.device) + self.cumulative_length.to(
                k_scale.device)
            twin.keys.index_copy_(2, positions, k_scale)
            twin.values.index_copy_(2, positions, v_scale)
            return twin.keys, twin.values
        return twin.update(k_scale, v_scale, *args, **kwargs)

    def reset(self) -> None:
        super().reset()
        if self.scales is not None:
            self.scales.reset()

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        if self.scales is not None:
            self.scales.crop(max_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.scales is not None:
            self.scales.reorder_cache(beam_idx)


def _static_codes(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x * (1 / scale) rounded to nearest even by the cast; saturated at +-448, NaN kept, as the weights' codes
    return saturate(x.float() * (1.0 / scale), x, E4M3.max).to(CODES)


E4M3_LAYERS = {base: type(f"E4M3{base.__name__}", (_E4M3Codes, base), {})
               for base in (StaticLayer, StaticSlidingWindowLayer)}


class FP8StaticCache(StaticCache):
    """transformers' `StaticCache` (same constructor) storing e4m3 codes: half a bf16 cache's bytes per token, plus
    4 bytes per (token, KV head) for the per-token scales. kv_scales: static per-tensor scales, one (k_scale,
    v_scale) pair per layer; None quantizes each token with its own scale."""

    def __init__(self, config, max_cache_len: int, *args,
                 kv_scales: list[tuple[float, float]] | None = None, **kwargs):
        super().__init__(config, max_cache_len, *args, **kwargs)
        if kv_scales is not None and len(kv_scales) != len(self.layers):
            raise ValueError(f"fxquant: FP8StaticCache got {len(kv_scales)} kv_scales pairs for "
                             f"{len(self.layers)} layers; give one (k_scale, v_scale) per layer")
        for index, layer in enumerate(self.layers):
            if type(layer) not in E4M3_LAYERS:
                raise ValueError(f"fxquant: FP8StaticCache stores attention layers only (StaticLayer, "
                                 f"StaticSlidingWindowLayer); layer {index} is a {type(layer).__name__}. Use "
                                 f"transformers' StaticCache for this model")
            pair = None if kv_scales is None else tuple(float(s) for s in kv_scales[index])
            if pair is not None and not all(s > 0 and s < float("inf") for s in pair):
                raise ValueError(f"fxquant: kv_scales[{index}] = {pair}: a static scale must be finite and > 0")
            # The layer, built by transformers for this model, with its state, as its e4m3 kind; the twin is the
            # same, still empty, layer: it tracks the same positions for the scales.
            e4m3 = object.__new__(E4M3_LAYERS[type(layer)])
            e4m3.__dict__.update(layer.__dict__, scales=None if pair else copy.deepcopy(layer), static_scales=pair)
            self.layers[index] = e4m3


def measured_kv_scales(cache: StaticCache) -> list[tuple[float, float]]:
    """Static per-tensor scales, one (k_scale, v_scale) per layer, of a high-precision StaticCache filled by
    calibration prompts: each layer's K and V amax / 448, so that nothing the prompts wrote would saturate."""
    pairs = []
    for index, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False) or layer.keys.dtype == torch.uint8:
            raise ValueError(f"fxquant: kv_scales_of needs a filled high-precision StaticCache; layer {index} is "
                             f"{'empty' if not getattr(layer, 'is_initialized', False) else 'e4m3 codes'}")
        pairs.append(tuple(float(scale_from_amax(t.float().abs().amax(), E4M3.max))  # fp32, as every scale here
                           for t in (layer.keys, layer.values)))
    return pairs
