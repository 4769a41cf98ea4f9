"""Fused RMSNorm / LayerNorm -> fp8 (Triton) against reference_norm: statistics to 2 ulp (their sum order is the
kernel's own), and everything after them bit for bit."""

import pytest
import torch
from fp8_cases import same_bits

from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
from fxquant.numerics import reference_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Shapes hit every branch: one row, D not a power of two (padded tail), several groups, 3-D input.
SHAPES = [(1, 256), (5, 384), (3, 1024), (2, 3, 512)]


def sample(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-4, 6, (*shape[:-1], 1), generator=gen).float())
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def ulps(a, b):
    return int((a.float().view(torch.int32) - b.float().view(torch.int32)).abs().max())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize("with_residual", [False, True], ids=["", "residual"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_kernel_matches_reference(shape, rms, group, with_residual, dtype):
    x = sample(shape, dtype)
    residual = sample(shape, dtype, seed=1) if with_residual else None
    weight = sample(shape[-1:], dtype, seed=2)
    bias = None if rms else sample(shape[-1:], dtype, seed=3)
    codes, scales, h, stats = norm_quant_fp8(x, weight, bias, 1e-5, group, rms=rms, residual=residual)
    _, _, _, (mean, rstd) = reference_norm.norm_quant_fp8(x, weight, bias, 1e-5, group, rms=rms, residual=residual)
    assert ulps(stats[..., 1], rstd) <= 2
    # A mean near zero has few significant bits left: bound it against the row's magnitude instead.
    assert (stats[..., 0] - mean).abs().max() <= 1e-6 * x.float().abs().max()
    ref_codes, ref_scales, ref_h, _ = reference_norm.norm_quant_fp8(
        x, weight, bias, 1e-5, group, rms=rms, residual=residual, stats=(stats[..., 0], stats[..., 1]))
    assert same_bits(codes, ref_codes) == 0 and torch.equal(scales, ref_scales)
    assert (h is None) == (residual is None) and (h is None or torch.equal(h, ref_h))


def test_norm_without_weight_and_nan_rows():
    x = sample((4, 256), torch.bfloat16)
    x[2, 7] = float("nan")
    codes, scales, _, stats = norm_quant_fp8(x, None, None, 1e-6, 128, rms=True)
    assert torch.isnan(scales[2]).all() and torch.isfinite(scales[[0, 1, 3]]).all()
    ref_codes, ref_scales, _, _ = reference_norm.norm_quant_fp8(x, None, None, 1e-6, 128, rms=True,
                                                                stats=(stats[..., 0], stats[..., 1]))
    assert same_bits(codes, ref_codes) == 0 and torch.equal(scales.nan_to_num(-1), ref_scales.nan_to_num(-1))


def test_zero_rows_quantize_to_zero():
    x = torch.zeros(3, 256, dtype=torch.bfloat16, device=DEVICE)
    codes, scales, _, _ = norm_quant_fp8(x, None, None, 1e-6, 0, rms=True)
    assert torch.equal(codes.float(), torch.zeros(3, 256, device=DEVICE)) and torch.isfinite(scales).all()


@pytest.mark.parametrize(("d", "group"), [(384, 256), (256, 96), (32768, 0)])
def test_unservable_shapes_are_clear_errors(d, group):
    with pytest.raises(ValueError, match="fused norm -> fp8 needs D"):
        norm_quant_fp8(torch.randn(2, d, device=DEVICE), None, None, 1e-6, group)
