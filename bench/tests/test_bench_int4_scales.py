"""bench.int4_scales' schemes: today's column is fxquant's int4 quantizer bit for bit, a searched scale never errs more
than the amax scale it starts from, and power-of-two group scales make every code an exact e4m3 value under the
channel's scale (what would let W4A8 run on the row-scaled fp8 GEMMs)."""

import pytest
import torch

from bench.int4_scales import (
    E4M3_SHIFT,
    GROUP,
    amax_groups,
    fake_quantized,
    power_of_two_scales,
    quantized_weight,
    searched_groups,
)
from fxquant.numerics import reference as R


def spread_weight(rows=64, columns=4 * GROUP, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=gen) * torch.exp(torch.randn(rows, 1, generator=gen))
    weight[:, :GROUP] *= 1e-3  # a group far under its channel's largest: the span's floor
    return weight * torch.exp(2 * torch.randn(1, columns, generator=gen))


@pytest.mark.parametrize("symmetric", [True, False], ids=["-7..7", "zero point"])
def test_amax_scales_are_fxquants_int4_quantizer(symmetric):
    weight = spread_weight()
    q = R.quantize(weight, "int4", ("group", GROUP), symmetric=symmetric)
    assert torch.equal(quantized_weight(weight, "amax scales (today)", symmetric), R.dequantize(q, torch.float32))


@pytest.mark.parametrize("symmetric", [True, False], ids=["-7..7", "zero point"])
def test_a_searched_scale_never_errs_more_than_the_amax_scale(symmetric):
    groups = spread_weight().reshape(64, -1, GROUP)
    error = lambda values: ((values - groups) ** 2).sum(-1)
    searched, amax = error(searched_groups(groups, symmetric)), error(amax_groups(groups, symmetric))
    assert (searched <= amax).all() and searched.sum() < 0.99 * amax.sum()


@pytest.mark.parametrize("symmetric", [True, False], ids=["-7..7", "zero point"])
def test_power_of_two_group_scales_make_every_code_an_exact_e4m3_value(symmetric):
    groups = spread_weight().reshape(64, -1, GROUP)
    values, scale, channel = power_of_two_scales(groups, symmetric)
    assert torch.equal(values, fake_quantized(groups, scale, symmetric))  # the values are these scales' codes
    exponent = torch.log2(scale / channel)
    assert torch.equal(exponent, exponent.round())
    assert (exponent <= 1).all() and (exponent >= -9 - E4M3_SHIFT[symmetric]).all()
    lo, hi = (-7, 7) if symmetric else (0, 15)
    zero = 0 if symmetric else torch.round(-groups.amin(-1, keepdim=True).clamp_max(0) / scale).clamp(lo, hi)
    codes = torch.clamp(torch.round(groups / scale) + zero, lo, hi) - zero  # q, or q - z
    e4m3 = codes * 2.0 ** (exponent + E4M3_SHIFT[symmetric])
    assert torch.equal(e4m3.to(torch.float8_e4m3fn).float(), e4m3) and e4m3.abs().max() <= 448
    assert (codes * 2.0 ** (exponent + E4M3_SHIFT[symmetric] - 1) != 0).any()  # not all zeros
    assert not torch.equal((e4m3 * 1.1).to(torch.float8_e4m3fn).float(), e4m3 * 1.1)  # the check can fail
