"""The decode fp8 GEMM with the row work after it in its epilogue, against the two kernels it stands for, on random
data: whole and split K, one and several output tiles, tails. NORM (fp8_scaled_mm, then norm_quant_fp8 with the
product as its residual): RMSNorm and LayerNorm, per token and 1 x 64 groups, a bias; under Triton's interpreter every
output is the two kernels' bits, on a GPU the sum is, and the norm's statistics sum in another thread layout, so a
code may move one e4m3 step. SILU (fp8_scaled_mm, then silu_mul_quantize_fp8_rows of its two halves): the two
kernels' bits everywhere, its row in several chunks and one (gemm_fp8_epilogue.py)."""

import pytest
import torch

from fxquant.kernels import gemm_fp8_epilogue, splitk
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_fp8_epilogue import (
    MAX_ROWS,
    NORM,
    SILU,
    fp8_scaled_mm_add_norm_quant,
    fp8_scaled_mm_silu_mul_quantize,
    refusal,
    silu_refusal,
)
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
from fxquant.kernels.quant_fp8 import silu_mul_quantize_fp8_rows
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PLANS = {"split in 2, four tiles": {"SPLIT_K": 2, "BLOCK_N": 64}, "whole K, two tiles": {"SPLIT_K": 1, "BLOCK_N": 128},
         "the decode plan": {}}


def operands(M, N, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = R.quantize((torch.randn(M, K, generator=gen) * 3).to(DEVICE), "fp8_e4m3", "token")
    w = R.quantize((torch.randn(N, K, generator=gen) * K ** -0.5).to(DEVICE), "fp8_e4m3", "channel")
    residual = (torch.randn(M, N, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    weight = (1 + torch.randn(N, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    return a, w, residual, weight


def unfused(a, w, bias, residual, weight, norm_bias, group, rms, config):
    product = fp8_scaled_mm(a.data, a.scale, w.data, w.scale, bias, residual.dtype, config)
    codes, scales, h, _ = norm_quant_fp8(residual, weight, norm_bias, 1e-6, group, rms=rms, residual=product)
    return codes, scales, h


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("M", [1, 3, MAX_ROWS[NORM]])
@pytest.mark.parametrize("norm", ["rms", "layer norm, group 64, bias"])
def test_one_kernel_gives_the_two_kernels_outputs(plan, M, norm):
    N, K = 256, 512
    a, w, residual, weight = operands(M, N, K, seed=M)
    rms, group = norm == "rms", 0 if norm == "rms" else 64
    bias = None if rms else torch.randn(N, device=DEVICE)
    norm_bias = None if rms else torch.randn(N, device=DEVICE).to(torch.bfloat16)
    config = PLANS[plan]
    assert refusal(a.data, a.scale, w.data, w.scale, residual, group, config) is None
    got = fp8_scaled_mm_add_norm_quant(a.data, a.scale, w.data, w.scale, bias, residual, weight, norm_bias, 1e-6,
                                       group, rms=rms, config=config)
    want = unfused(a, w, bias, residual, weight, norm_bias, group, rms, config)
    codes, scales, h = got
    assert codes.shape == (M, N) and scales.shape == (M, N // group if group else 1) and h.dtype == torch.bfloat16
    assert torch.equal(h, want[2])  # the residual stream: the product's bits, added as the norm kernel adds
    if DEVICE == "cpu":
        assert torch.equal(codes.view(torch.uint8), want[0].view(torch.uint8)) and torch.equal(scales, want[1])
    else:
        steps = (codes.view(torch.uint8).int() - want[0].view(torch.uint8).int()).abs()
        assert steps.max() <= 1 and steps.float().mean() < 0.01
        torch.testing.assert_close(scales, want[1], rtol=2 ** -7, atol=0)
    assert not splitk.counters(torch.device(DEVICE), 1).any()  # every counter left zero for the next kernel


@pytest.mark.parametrize("plan", ["split in 2, four tiles", "the decode plan"])
def test_tails_of_n_and_k_and_a_bf16_bias(plan):
    """N = 200 and K = 176 leave masked tiles in the GEMM and a masked tail in the norm's row (256 wide)."""
    a, w, residual, weight = operands(5, 200, 176, seed=7)
    bias = torch.randn(200, device=DEVICE).to(torch.bfloat16)
    config = PLANS[plan]
    assert refusal(a.data, a.scale, w.data, w.scale, residual, 0, config) is None
    got = fp8_scaled_mm_add_norm_quant(a.data, a.scale, w.data, w.scale, bias, residual, weight, None, 1e-6,
                                       config=config)
    want = unfused(a, w, bias, residual, weight, None, 0, True, config)
    assert torch.equal(got[2], want[2])
    if DEVICE == "cpu":
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want, strict=True))


def test_what_it_does_not_take_runs_the_two_kernels():
    """Past MAX_ROWS rows, block scales and an unaligned norm width each name why, and give the two kernels'
    outputs."""
    a, w, residual, weight = operands(MAX_ROWS[NORM] + 1, 256, 256)
    assert "rows" in refusal(a.data, a.scale, w.data, w.scale, residual, 0)
    got = fp8_scaled_mm_add_norm_quant(a.data, a.scale, w.data, w.scale, None, residual, weight, None, 1e-6)
    want = unfused(a, w, None, residual, weight, None, 0, True, None)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want, strict=True))
    blocks = R.quantize(torch.randn(256, 256, device=DEVICE), "fp8_e4m3", ("block", 128, 128))
    groups = R.quantize(torch.randn(1, 256, device=DEVICE), "fp8_e4m3", ("group", 128))
    assert "block scales" in refusal(groups.data, groups.scale, blocks.data, blocks.scale, residual[:1], 0)
    assert "group 96" in refusal(a.data[:1], a.scale[:1], w.data, w.scale, residual[:1], 96)


def silu_unfused(a, a_scale, w, bias, config):
    product = fp8_scaled_mm(a, a_scale, w.data, w.scale, bias, torch.bfloat16, config)
    width = product.shape[1] // 2
    return silu_mul_quantize_fp8_rows(product[:, :width], product[:, width:], width)


def same_bits(got, want) -> bool:
    """Codes and scales equal bit for bit, NaN scales included."""
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want, strict=True))


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("M", [1, 3, MAX_ROWS[SILU]])
@pytest.mark.parametrize("chunk", [64, 2048], ids=["a row in chunks", "a row in one chunk"])
def test_silu_in_the_epilogue_gives_the_two_kernels_bits(plan, M, chunk, monkeypatch):
    """gate and up are the merged product's halves (384 columns each: a tail past every 64-wide chunk), with a bias."""
    monkeypatch.setattr(gemm_fp8_epilogue, "SILU_CHUNK", chunk)
    N, K = 768, 512
    a, w, _, _ = operands(M, N, K, seed=M + 1)
    bias = torch.randn(N, device=DEVICE).to(torch.bfloat16)
    config = PLANS[plan]
    assert silu_refusal(a.data, a.scale, w.data, w.scale, torch.bfloat16, config) is None
    got = fp8_scaled_mm_silu_mul_quantize(a.data, a.scale, w.data, w.scale, bias, config=config)
    assert got[0].shape == (M, N // 2) and got[1].shape == (M, 1) and torch.isfinite(got[1]).all()
    assert same_bits(got, silu_unfused(a.data, a.scale, w, bias, config))
    assert not splitk.counters(torch.device(DEVICE), 1).any()


def test_a_nan_in_the_product_poisons_every_token_s_scale_as_the_silu_kernel_s():
    """A NaN bias in the up half: every token's row holds a NaN, so every scale is NaN, as in the two kernels."""
    a, w, _, _ = operands(3, 256, 256, seed=4)
    bias = torch.zeros(256, device=DEVICE).to(torch.bfloat16)
    bias[200] = float("nan")
    got = fp8_scaled_mm_silu_mul_quantize(a.data, a.scale, w.data, w.scale, bias)
    assert got[1].isnan().all() and same_bits(got, silu_unfused(a.data, a.scale, w, bias, None))


def test_what_silu_does_not_take_runs_the_two_kernels():
    a, w, _, _ = operands(MAX_ROWS[SILU] + 1, 256, 256)
    assert "rows" in silu_refusal(a.data, a.scale, w.data, w.scale, torch.bfloat16)
    got = fp8_scaled_mm_silu_mul_quantize(a.data, a.scale, w.data, w.scale, None)
    assert same_bits(got, silu_unfused(a.data, a.scale, w, None, None))
    odd = R.quantize(torch.randn(255, 256, device=DEVICE), "fp8_e4m3", "channel")
    assert "gate and up are its two halves" in silu_refusal(a.data[:1], a.scale[:1], odd.data, odd.scale,
                                                            torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_both_epilogues_in_fp16_and_fp32_models(dtype):
    """The product rounded to, and the residual stream kept in, the model's dtype: fp16 and fp32 as bf16."""
    a, w, residual, weight = operands(3, 256, 512, seed=9)
    residual, weight = residual.to(dtype), weight.to(dtype)
    got = fp8_scaled_mm_add_norm_quant(a.data, a.scale, w.data, w.scale, None, residual, weight, None, 1e-6)
    want = unfused(a, w, None, residual, weight, None, 0, True, None)
    assert got[2].dtype == dtype and torch.equal(got[2], want[2])
    if DEVICE == "cpu":
        assert same_bits(got, want)
    product = fp8_scaled_mm(a.data, a.scale, w.data, w.scale, None, dtype)
    got = fp8_scaled_mm_silu_mul_quantize(a.data, a.scale, w.data, w.scale, None, dtype)
    assert same_bits(got, silu_mul_quantize_fp8_rows(product[:, :128], product[:, 128:], 128))
