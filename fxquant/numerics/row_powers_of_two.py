"""Symmetric int4 group scales that are each a power of two times their row's scale: W4A8's row-scaled form.

A group scale s_g = r * 2^k with k in [LOWEST, HIGHEST] makes every code q (-8..7) times 2^k an e4m3 value
exactly: |q| needs at most 4 significant bits, which e4m3 holds from its subnormals' 2^-9 steps (k >= -9) up to
15 * 2^4 = 240 <= 448 (k <= 4). So the fp8 tensor cores multiply the codes, shifted by their groups' powers of two,
with one scale per row r, exactly the product of the codes with their fp32 group scales: W4A8's large-M GEMMs run
row-scaled (cuBLAS's rowwise GEMM, CUTLASS's grouped one) instead of scaling each 128-wide K step's partial.
Every other reader (the decode kernels, the dequantizer, checkpoints) takes the same fp32 group scales as ever.

The quantizer, per row: the channel scale c is the row's largest amax scale (amax / 7) times 2^(-f / OFFSETS) for
the offset f in 0..OFFSETS-1 whose row errs least; each group's exponent is the binade at or above its amax scale,
or the one under it where that errs less (squared error, summed in fp64). On all-MiniLM-L6-v2 this kept 18.33 dB
of weight SQNR against the amax scales' 17.94, and the MiniLM set's cosine 0.9415 against 0.9305
(`python -m bench.int4_scales`, bench/results/2026-12-07/int4_scales_c54959b.txt). Exponents come from frexp, never
log2, so the CPU and the GPU pick the same binades; the errors they compare are summed in another order on each,
so a pick could differ only where two candidates' errors agree to about 1e-15.
"""

from __future__ import annotations

import torch

from fxquant.numerics.formats import AMAX_FLOOR, fdiv
from fxquant.numerics.int4 import SYMMETRIC_MAX, squared_error

SCALE_MODE = "row_powers_of_two"  # int4's scale_mode for this form
LOWEST, HIGHEST = -9, 4  # a group's power of two relative to its row's scale: see above
OFFSETS = 8  # channel scales tried a row, 2^(1/8) apart


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k for integer k in fp32's normal range, built from its exponent bits: exact on every device."""
    return ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def _binade_at_or_above(ideal: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """The least integer k with channel * 2^k >= ideal (both positive, finite), exactly, from their frexp."""
    m_i, e_i = torch.frexp(ideal)
    m_c, e_c = torch.frexp(channel)
    return e_i - e_c + (m_i > m_c).to(e_i.dtype)


def group_scales(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(group scales [..., G], row scales [..., 1]) for finite-or-poisoned blocks xb [..., G, B] (rows: the leading
    dims): s_g = r * 2^k, k in [LOWEST, HIGHEST]. A group holding NaN or inf keeps a NaN scale (its own poison only);
    an all-zero group takes the floor's scale, or the lowest binade of its row."""
    finite = torch.isfinite(xb).all(-1)
    # amax scales (0 where poisoned), divided as IEEE on every device, as the reference's
    ideal = torch.where(finite, fdiv(xb.abs().amax(-1).clamp_min(AMAX_FLOOR), SYMMETRIC_MAX), 0.0)
    top = ideal.amax(-1, keepdim=True).clamp_min(AMAX_FLOOR / SYMMETRIC_MAX)
    clean = torch.where(finite[..., None], xb, 0.0)  # poisoned groups choose nothing: their error is theirs
    span = HIGHEST - LOWEST
    best_scale = best_error = None
    for f in range(OFFSETS):
        channel = top * 2.0 ** (-f / OFFSETS)
        up = _binade_at_or_above(torch.where(finite, ideal, channel), channel).clamp(1 - span, 1)  # <= 1: ideal <= 2c
        below = (up - 1).clamp_min(1 - span)
        s_up, s_below = channel * _pow2(up), channel * _pow2(below)
        e_up, e_below = squared_error(clean, s_up, None), squared_error(clean, s_below, None)
        take_below = e_below < e_up
        scale = torch.where(take_below, s_below, s_up)
        error = torch.where(take_below, e_below, e_up).sum(-1, keepdim=True)
        if best_scale is None:
            best_scale, best_error = scale, error
        else:
            better = error < best_error
            best_scale = torch.where(better, scale, best_scale)
            best_error = torch.minimum(error, best_error)
    scale = torch.where(finite, best_scale, torch.nan)
    return scale, _row_of(scale)  # every exponent within [1 - span, 1] of c, so each k is in range


def _row_of(scale: torch.Tensor) -> torch.Tensor:
    """The row scale of group scales [..., G] in this form: the largest finite one over 2^HIGHEST (the floor's scale
    where a row has none: its groups are all poisoned, and any positive row scale keeps them NaN)."""
    largest = torch.where(torch.isfinite(scale), scale, 0.0).amax(-1, keepdim=True)
    return torch.where(largest > 0, largest, AMAX_FLOOR / SYMMETRIC_MAX) * 2.0**-HIGHEST


def row_scale_of(scale: torch.Tensor) -> torch.Tensor | None:
    """The row scales [..., N, 1] that symmetric int4 group scales [..., N, G] are in this form of, or None where
    any row's finite scales are not each a power of two in [2^LOWEST, 2^HIGHEST] times one row scale (a checkpoint
    quantized otherwise). NaN scales (poisoned groups) are allowed. One host read."""
    scale = scale.float()
    finite = torch.isfinite(scale)
    if bool((finite & (scale <= 0)).any()):
        return None
    row = _row_of(scale)
    mantissa_s, exponent_s = torch.frexp(torch.where(finite, scale, row))
    mantissa_r, exponent_r = torch.frexp(row)
    k = exponent_s - exponent_r
    return row if bool(((mantissa_s == mantissa_r) & (k >= LOWEST) & (k <= HIGHEST)).all()) else None
