"""Error metrics shared by the report, the lint and `fxquant.inspect`."""

from __future__ import annotations

import math

import torch


def sqnr_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """10 log10(|exact|^2 / |approx - exact|^2), in fp64; NaN when either side is not finite."""
    exact, approx = exact.detach().double(), approx.detach().double()
    return _ratio_db(exact.pow(2).sum(), (approx - exact).pow(2).sum())


def _ratio_db(signal: torch.Tensor, noise: torch.Tensor) -> float:
    """signal / noise in dB: NaN where either is not finite, inf where the noise is zero."""
    if not (torch.isfinite(noise) and torch.isfinite(signal)):
        return math.nan
    return math.inf if noise == 0 else float(10 * torch.log10(signal / noise))


def row_sums(approx: torch.Tensor, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sum of exact^2 and of (approx - exact)^2 over the last dim, in fp64: the parts a weight's SQNR and
    its worst row's are made of, summed a few rows at a time by the caller."""
    exact = exact.detach().double()
    # a copy (even of fp64 rows), then in place: two fp64 copies of the rows at most, and the caller's left as given
    noise = approx.detach().to(torch.float64, copy=True).sub_(exact).square_()
    return exact.square().sum(-1), noise.sum(-1)


def sqnrs_of_row_sums(signal: torch.Tensor, noise: torch.Tensor) -> tuple[float, float]:
    """(SQNR, lowest row SQNR) in dB from rows' `row_sums`. The whole's is NaN when either sum is not finite; rows
    that are exactly zero are skipped by the lowest (a few outliers can keep the whole tensor's SQNR high while the
    scale they set flushes every other row)."""
    whole = _ratio_db(signal.sum(), noise.sum())
    live = signal > 0
    if not live.any():
        return whole, math.inf
    return whole, float(10 * torch.log10((signal[live] / noise[live]).min()))  # noise 0: inf
