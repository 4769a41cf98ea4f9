"""int4 group scales in the row-scaled form (numerics/row_powers_of_two.py): each a power of two in [2^-9, 2^4] times
its row's scale, so every code times its power of two is an e4m3 value; what the quantizer picks, how poison and
zeros fare, and that the form is recognised in scales from elsewhere (a checkpoint) and refused where it does not
hold."""

import pytest
import torch

from fxquant.numerics import reference as R
from fxquant.numerics.metrics import sqnr_db
from fxquant.numerics.minifloat import unpack_nibbles
from fxquant.numerics.row_powers_of_two import HIGHEST, LOWEST, SCALE_MODE, row_scale_of
from fxquant.numerics.row_powers_of_two import group_scales as row_group_scales

GROUP = 128


def spread_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Random rows whose channels and columns differ in magnitude, as trained weights' do."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    return w * torch.exp(0.5 * torch.randn(n, 1, generator=gen)) * torch.exp(torch.randn(1, k, generator=gen))


def powers(q) -> tuple[torch.Tensor, torch.Tensor]:
    """(mantissas, exponents) of each finite group scale over its row scale."""
    ratio = q.scale / q.row_scale
    mantissa, exponent = torch.frexp(ratio[torch.isfinite(ratio)])
    return mantissa, exponent - 1  # frexp's mantissa is in [0.5, 1)


def test_each_group_scale_is_a_power_of_two_of_its_row_scale_in_range():
    q = R.quantize(spread_weight(64, 1024, 0), "int4", ("group", GROUP), symmetric=True, scale_mode=SCALE_MODE)
    mantissa, exponent = powers(q)
    assert bool((mantissa == 0.5).all())
    assert int(exponent.min()) >= LOWEST and int(exponent.max()) == HIGHEST  # the row's largest group at the top
    assert q.row_scale.shape == (64, 1) and q.scale_mode == SCALE_MODE and q.zero_point is None


def test_every_code_times_its_power_of_two_is_an_e4m3_value():
    q = R.quantize(spread_weight(32, 2048, 1), "int4", ("group", GROUP), symmetric=True, scale_mode=SCALE_MODE)
    codes = ((unpack_nibbles(q.data).to(torch.int32) ^ 8) - 8).double()  # sign-extended, as dequantize reads them
    shifted = codes * (q.scale / q.row_scale).double().repeat_interleave(GROUP, -1)
    assert bool((codes.abs() == 7).any())
    assert torch.equal(shifted.to(torch.float8_e4m3fn).double(), shifted)


@pytest.mark.parametrize("spread", [(0.0, 0.0), (0.3, 0.5), (0.5, 1.0), (1.0, 0.0)], ids=str)
def test_it_errs_about_as_little_as_the_groups_amax_scales(spread):
    """Coarser scales (powers of two), each group's binade and the row's scale picked for the least squared error:
    on random weights within 0.5 dB of each group's amax / 7 either way, and on
    all-MiniLM-L6-v2's weights above it (18.33 dB against 17.94, bench/int4_scales.py)."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(128, 2048, generator=gen) * torch.exp(spread[0] * torch.randn(128, 1, generator=gen)) * \
        torch.exp(spread[1] * torch.randn(1, 2048, generator=gen))
    sqnr = lambda **kw: sqnr_db(R.dequantize(R.quantize(w, "int4", ("group", GROUP), symmetric=True, **kw),
                                             torch.float32), w)
    assert sqnr(scale_mode=SCALE_MODE) > sqnr() - 0.5


def test_a_poisoned_group_keeps_its_nan_and_zeros_stay_zero():
    w = spread_weight(8, 512, 3)
    w[1, 130] = float("inf")
    w[2] = 0.0
    q = R.quantize(w, "int4", ("group", GROUP), symmetric=True, scale_mode=SCALE_MODE)
    out = R.dequantize(q, torch.float32)
    assert bool(torch.isnan(q.scale[1, 1])) and int(torch.isnan(q.scale).sum()) == 1
    assert bool(torch.isnan(out[1, GROUP:2 * GROUP]).all()) and bool(torch.isfinite(out[1, :GROUP]).all())
    assert bool((out[2] == 0).all()) and bool((q.row_scale > 0).all())
    assert torch.equal(row_scale_of(q.scale), q.row_scale)


def test_the_form_is_recognised_in_stored_scales_and_refused_where_it_fails():
    q = R.quantize(spread_weight(16, 512, 4), "int4", ("group", GROUP), symmetric=True, scale_mode=SCALE_MODE)
    assert torch.equal(row_scale_of(q.scale), q.row_scale)
    amax = R.quantize(spread_weight(16, 512, 4), "int4", ("group", GROUP), symmetric=True)
    assert row_scale_of(amax.scale) is None  # amax / 7 scales share no mantissa
    far = q.scale.clone()
    far[0, 0] = q.row_scale[0, 0] * 2.0 ** (LOWEST - 1)  # a power of two, one binade below the range
    assert row_scale_of(far) is None
    negative = q.scale.clone()
    negative[3, 2] *= -1
    assert row_scale_of(negative) is None


def test_stacked_experts_keep_their_row_scales():
    w = torch.stack([spread_weight(16, 256, 5), spread_weight(16, 256, 6)])
    parts = [R.quantize(w[e], "int4", ("group", GROUP), symmetric=True, scale_mode=SCALE_MODE) for e in range(2)]
    stacked = R.stack_experts(parts)
    assert stacked.row_scale.shape == (2, 16, 1)
    assert torch.equal(R.expert(stacked, 1).row_scale, parts[1].row_scale)


def test_the_scales_are_the_same_on_every_device_and_chunking():
    """Whole rows are independent: a block of rows gets the scales it gets inside the whole weight."""
    w = spread_weight(48, 512, 7)
    whole, _ = row_group_scales(w.reshape(48, -1, GROUP))
    part, _ = row_group_scales(w[16:32].reshape(16, -1, GROUP))
    assert torch.equal(whole[16:32], part)
    if torch.cuda.is_available():
        gpu, _ = row_group_scales(w.cuda().reshape(48, -1, GROUP))
        assert torch.equal(gpu.cpu(), whole)


@pytest.mark.parametrize(("fmt", "granularity", "symmetric"), [("int4", ("group", GROUP), False),
                                                             ("int8", "channel", False)], ids=["zero_point", "int8"])
def test_it_refuses_other_formats_and_zero_points(fmt, granularity, symmetric):
    with pytest.raises(ValueError, match="row_powers_of_two"):
        R.quantize(torch.randn(4, 256), fmt, granularity, scale_mode=SCALE_MODE, symmetric=symmetric)
