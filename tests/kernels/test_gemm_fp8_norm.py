"""The decode fp8 GEMM with the add, norm and quantizer in its epilogue, against the two kernels it stands for
(fp8_scaled_mm, then norm_quant_fp8 with the product as its residual), on random data: whole and split K, one and
several output tiles, RMSNorm and LayerNorm, per token and 1 x 64 groups, a bias. Under Triton's interpreter every
output is the two kernels' bits; on a GPU the sum is, and the norm's statistics sum in another thread layout, so a
code may move one e4m3 step (gemm_fp8_norm.py)."""

import pytest
import torch

from fxquant.kernels import splitk
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_fp8_norm import MAX_ROWS, fp8_scaled_mm_add_norm_quant, refusal
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
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
@pytest.mark.parametrize("M", [1, 3, MAX_ROWS])
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
    a, w, residual, weight = operands(MAX_ROWS + 1, 256, 256)
    assert "rows" in refusal(a.data, a.scale, w.data, w.scale, residual, 0)
    got = fp8_scaled_mm_add_norm_quant(a.data, a.scale, w.data, w.scale, None, residual, weight, None, 1e-6)
    want = unfused(a, w, None, residual, weight, None, 0, True, None)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want, strict=True))
    blocks = R.quantize(torch.randn(256, 256, device=DEVICE), "fp8_e4m3", ("block", 128, 128))
    groups = R.quantize(torch.randn(1, 256, device=DEVICE), "fp8_e4m3", ("group", 128))
    assert "block scales" in refusal(groups.data, groups.scale, blocks.data, blocks.scale, residual[:1], 0)
    assert "group 96" in refusal(a.data[:1], a.scale[:1], w.data, w.scale, residual[:1], 96)
