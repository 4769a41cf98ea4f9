"""int4's codes and group scales: symmetric (-7..7, no zero point) or 0..15 with a zero point per group.

Two ways to pick a group's scale:
- amax (`fxquant.quantize`'s default): the group's amax over 7, or its span [min(x, 0), max(x, 0)] over 15; nothing
  clips.
- SEARCHED (the int4 weight-only recipes'): that scale times whichever of SEARCH_FACTORS (1, 0.95, .. 0.65) gives
  the group's codes the least squared error, summed in fp64; the first wins a tie, so a group the amax scale
  serves best (an all-zero one, say) keeps it. Clipping a group's outlier to round its other 127 values finer is
  what the search trades: compiled under the int4_wo and int4_sym_wo recipes' schemes, the MiniLM set's cosine rose
  from 0.9500 to 0.9539 and from 0.9305 to 0.9446 (`tests/test_minilm.py`'s model, CPU). Its candidates are exact
  fp32 products and every division is IEEE, so the CPU and the GPU round the same codes (tested on both); their
  errors are summed in another order on each, so a pick could differ only where two candidates' errors agree to
  about 1e-15 (docs/decisions/0042-int4-weight-only-scales-searched.md).
Either way a group holding NaN or inf gets a NaN scale (its own poison only) and codes 0.
"""

from __future__ import annotations

import torch

from fxquant.numerics.formats import AMAX_FLOOR, apply_scale, fdiv

SEARCHED = "searched"  # int4's scale_mode for the searched scales
SEARCH_FACTORS = tuple(1 - 0.05 * i for i in range(8))  # the amax scale stepped down 5% at a time, to 0.65
SYMMETRIC_MAX, ZERO_POINT_MAX = 7.0, 15.0  # +-7 keeps negation exact; 0..15 with a zero point


def symmetric_codes(xb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes -7..7 (int32) of groups xb [..., G, B] under scale [..., G], rounded half to even; a non-finite
    element stores 0 (its group's NaN scale carries the poison)."""
    q = apply_scale(xb, scale).clamp(-SYMMETRIC_MAX, SYMMETRIC_MAX)
    return torch.round(torch.where(torch.isfinite(xb), q, torch.nan)).nan_to_num(0.0).to(torch.int32)


def zero_point_codes(xb: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes 0..15 (int32), zero points [..., G] (fp32)) of groups xb under scale, their range starting at lo
    (<= 0): the zero point is -lo / scale rounded half to even, so zero stays exact."""
    zp = torch.round(-lo / scale).clamp(0, ZERO_POINT_MAX).nan_to_num(0.0)
    q = (torch.round(apply_scale(xb, scale)) + zp[..., None]).clamp(0, ZERO_POINT_MAX).nan_to_num(0.0)
    return q.to(torch.int32), zp


def _finite_or_nan(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(v), v, torch.nan)  # inf - inf and friends poison the group


def amax_scales(xb: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the amax scales [..., G], each group's range start lo (zero points only, else None)). The floor keeps an
    all-zero group at a scale > 0 (zeros out, never 0/0); clamp_min keeps NaN."""
    if xb.shape[-1] == 0:
        zeros = xb.new_zeros(xb.shape[:-1])
        return fdiv(zeros.clamp_min(AMAX_FLOOR), SYMMETRIC_MAX if symmetric else ZERO_POINT_MAX), (
            None if symmetric else zeros)
    if symmetric:
        return fdiv(_finite_or_nan(xb.abs().amax(-1)).clamp_min(AMAX_FLOOR), SYMMETRIC_MAX), None
    lo, hi = xb.amin(-1).clamp_max(0), xb.amax(-1).clamp_min(0)  # the range includes 0, so zero is exact
    return fdiv(_finite_or_nan(hi - lo).clamp_min(AMAX_FLOOR), ZERO_POINT_MAX), lo


def quantize_groups(xb: torch.Tensor, symmetric: bool, searched: bool = False):
    """(codes [..., G, B] as int32, scales [..., G] fp32, zero points [..., G] fp32 or None) of groups xb."""
    scale, lo = amax_scales(xb, symmetric)
    if searched:
        scale = _searched(xb, scale, lo)
    if symmetric:
        return symmetric_codes(xb, scale), scale, None
    codes, zp = zero_point_codes(xb, scale, lo)
    return codes, scale, zp


def squared_error(xb: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    """Each group's squared error [..., G] under scale (lo: the zero-point range's start, None for symmetric codes),
    summed in fp64 (NaN for a poisoned group): the values dequantized as the codes above give them, in place, so that
    a search costs a few passes a candidate."""
    values = apply_scale(xb, scale)
    if lo is None:
        values.clamp_(-SYMMETRIC_MAX, SYMMETRIC_MAX).round_()
    else:
        zp = torch.round(-lo / scale).clamp(0, ZERO_POINT_MAX)[..., None]
        values.round_().add_(zp).clamp_(0, ZERO_POINT_MAX).sub_(zp)
    return values.mul_(scale[..., None]).sub_(xb).square_().sum(-1, dtype=torch.float64)


def _searched(xb: torch.Tensor, amax_scale: torch.Tensor, lo: torch.Tensor | None) -> torch.Tensor:
    """Of the amax scale times each search factor, each group's least-error one (the first at a tie)."""
    best_scale, best_error = amax_scale, squared_error(xb, amax_scale, lo)
    for factor in SEARCH_FACTORS[1:]:
        scale = amax_scale * torch.full_like(amax_scale, factor)  # an exact fp32 product on every device
        error = squared_error(xb, scale, lo)
        better = error < best_error  # NaN (a poisoned group) is never better: it keeps its NaN scale
        best_scale, best_error = torch.where(better, scale, best_scale), torch.where(better, error, best_error)
    return best_scale
