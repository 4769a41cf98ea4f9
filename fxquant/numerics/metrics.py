"""Error metrics shared by the report, the lint and `fxquant.inspect`."""

from __future__ import annotations

import math

import torch


def sqnr_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """10 log10(|exact|^2 / |approx - exact|^2), in fp64; NaN when either side is not finite."""
    exact, approx = exact.detach().double(), approx.detach().double()
    noise = (approx - exact).pow(2).sum()
    signal = exact.pow(2).sum()
    if not (torch.isfinite(noise) and torch.isfinite(signal)):
        return math.nan
    return math.inf if noise == 0 else float(10 * torch.log10(signal / noise))


def worst_row_sqnr_db(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """The lowest SQNR over the rows of a 2-D tensor (rows that are exactly zero are skipped): a few outliers can
    keep the whole tensor's SQNR high while the scale they set flushes every other row."""
    exact, approx = exact.detach().double(), approx.detach().double()
    signal = exact.pow(2).sum(-1)
    noise = (approx - exact).pow(2).sum(-1)
    live = signal > 0
    if not live.any():
        return math.inf
    ratio = signal[live] / noise[live]  # noise 0: inf
    return float(10 * torch.log10(ratio.min()))
