"""int4 group scales searched for each group's least squared error (numerics/int4.py, the int4 weight-only
recipes'): which scale each group gets, that no group errs more than under its amax scale, how poison and zeros
fare, and that the CPU and the GPU pick the same scales."""

import pytest
import torch

from fxquant.config import RECIPES
from fxquant.numerics import reference as R
from fxquant.numerics.int4 import (
    SEARCH_FACTORS,
    SEARCHED,
    amax_scales,
    quantize_groups,
    symmetric_codes,
    zero_point_codes,
)
from fxquant.numerics.metrics import sqnr_db

GROUP = 128
SCHEMES = pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])


def spread_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Random rows whose channels and columns differ in magnitude, as trained weights' do."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    return w * torch.exp(0.5 * torch.randn(n, 1, generator=gen)) * torch.exp(torch.randn(1, k, generator=gen))


def group_errors(w: torch.Tensor, q) -> torch.Tensor:
    """Each group's squared error [N, G] in fp64."""
    error = (R.dequantize(q, torch.float32).double() - w.double()) ** 2
    return error.reshape(w.shape[0], -1, GROUP).sum(-1)


@SCHEMES
def test_each_group_takes_the_factor_of_its_least_error(symmetric):
    """Brute force: every candidate's codes and error, group by group, and the scale picked is the first of the
    least."""
    xb = spread_weight(8, 512, 0).reshape(8, -1, GROUP)
    amax, lo = amax_scales(xb, symmetric)
    _, scale, _ = quantize_groups(xb, symmetric, searched=True)
    candidates = torch.stack([amax * torch.full_like(amax, f) for f in SEARCH_FACTORS])  # [factors, N, G]
    errors = []
    for candidate in candidates:
        if symmetric:
            values = symmetric_codes(xb, candidate).double() * candidate[..., None].double()
        else:
            codes, zp = zero_point_codes(xb, candidate, lo)
            values = (codes.double() - zp[..., None].double()) * candidate[..., None].double()
        errors.append(((values - xb.double()) ** 2).sum(-1))
    best = torch.stack(errors).argmin(0)  # the first of equal minima
    assert torch.equal(scale, torch.gather(candidates, 0, best[None])[0])
    assert best.unique().numel() >= 3  # the groups took several factors, not one


@SCHEMES
@pytest.mark.parametrize("spread", [(0.0, 0.0), (0.5, 1.0)], ids=["plain", "spread"])
def test_no_group_errs_more_than_under_its_amax_scale(symmetric, spread):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 1024, generator=gen) * torch.exp(spread[0] * torch.randn(64, 1, generator=gen)) * \
        torch.exp(spread[1] * torch.randn(1, 1024, generator=gen))
    amax = R.quantize(w, "int4", ("group", GROUP), symmetric=symmetric)
    searched = R.quantize(w, "int4", ("group", GROUP), symmetric=symmetric, scale_mode=SEARCHED)
    assert bool((group_errors(w, searched) <= group_errors(w, amax) * (1 + 1e-6)).all())
    gain = sqnr_db(R.dequantize(searched, torch.float32), w) - sqnr_db(R.dequantize(amax, torch.float32), w)
    assert gain > 0.1, gain  # Gaussian groups: their largest value is an outlier worth clipping


@SCHEMES
def test_a_poisoned_group_keeps_its_nan_and_zeros_stay_zero(symmetric):
    w = spread_weight(4, 512, 2)
    w[1, 130] = float("nan")
    w[2] = 0.0
    q = R.quantize(w, "int4", ("group", GROUP), symmetric=symmetric, scale_mode=SEARCHED)
    out = R.dequantize(q, torch.float32)
    assert int(torch.isnan(q.scale).sum()) == 1 and bool(torch.isnan(q.scale[1, 1]))
    assert bool(torch.isnan(out[1, GROUP:2 * GROUP]).all()) and int(torch.isnan(out).sum()) == GROUP
    assert bool((out[2] == 0).all())
    amax = R.quantize(w, "int4", ("group", GROUP), symmetric=symmetric)
    assert torch.equal(q.scale[2], amax.scale[2])  # every factor ties at zero error: the first, amax's, stays


@SCHEMES
def test_the_scales_are_the_same_on_every_device(symmetric):
    w = spread_weight(64, 1024, 3)
    cpu = R.quantize(w, "int4", ("group", GROUP), symmetric=symmetric, scale_mode=SEARCHED)
    part = R.quantize(w[16:32], "int4", ("group", GROUP), symmetric=symmetric, scale_mode=SEARCHED)
    assert torch.equal(part.scale, cpu.scale[16:32])  # groups are independent
    if torch.cuda.is_available():
        gpu = R.quantize(w.cuda(), "int4", ("group", GROUP), symmetric=symmetric, scale_mode=SEARCHED)
        assert torch.equal(gpu.scale.cpu(), cpu.scale) and torch.equal(gpu.data.cpu(), cpu.data)


def test_the_int4_weight_only_recipes_search_and_w4a8_keeps_its_form():
    assert RECIPES["int4_wo"].scale_mode == RECIPES["int4_sym_wo"].scale_mode == SEARCHED
    assert RECIPES["int4_fp8"].scale_mode != SEARCHED  # its row-scaled GEMMs need powers of two of a row scale


def test_other_formats_refuse_it():
    with pytest.raises(ValueError, match="searched"):
        R.quantize(torch.randn(4, 256), "int8", "channel", scale_mode=SEARCHED)
