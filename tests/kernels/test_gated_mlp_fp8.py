"""The gated MLP in two fp8 GEMMs against its three kernels (gate/up GEMM, silu_mul_quant, down GEMM), bit for bit."""

import pytest
import torch

from fxquant.kernels.gated_mlp_fp8 import down_from_rows_fp8, gated_mlp_fp8, silu_mul_rows_fp8
from fxquant.kernels.gemm_fp8 import _launch_plan, fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
# Small tiles so the interpreter runs several programs over every tail: 8 gate and 8 up rows a gate/up tile; the
# down product's K cut into slices that the last one sums.
SMALL_GU = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2, programs=8)
SMALL_DOWN = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=4, num_stages=2, programs=16)


def weights(n: int, k: int, gen: torch.Generator):
    q = R.quantize((torch.randn(n, k, generator=gen) * 0.05).to(DEVICE), "fp8_e4m3", "channel")
    return q.data, q.scale


def three_kernels(a, a_scale, w_gu, s_gu, w_down, s_down, config_gu, config_down):
    gate, up = fp8_scaled_mm(a, a_scale, w_gu, s_gu, None, BF16, config_gu).chunk(2, dim=-1)
    codes, scales = silu_mul_quantize_fp8_rows(gate, up, gate.shape[-1])
    return fp8_scaled_mm(codes, scales, w_down, s_down, None, BF16, config_down), gate, up


@pytest.mark.parametrize(("M", "K", "inter", "N", "split"),
                         [(1, 64, 40, 48, 1), (5, 96, 64, 32, 1), (16, 64, 72, 40, 1), (2, 64, 264, 32, 2)], ids=str)
def test_two_gemms_give_the_three_kernels_bits(M, K, inter, N, split):
    """inter = 40, 72 and 264 leave a gate/up tile half past the last column; K = 96 and inter = 40, 72, 264 leave K
    tails;
    the down product over inter = 264 is cut into two K slices, which the last one sums."""
    assert _launch_plan(M, N, inter, False, False, tuple(sorted(SMALL_DOWN.items())))[1] == split
    gen = torch.Generator().manual_seed(M)
    a, a_scale = quantize_fp8_rows((torch.randn(M, K, generator=gen) * 3).to(DEVICE).to(BF16), K)
    (w_gu, s_gu), (w_down, s_down) = weights(2 * inter, K, gen), weights(N, inter, gen)
    expected, gate, up = three_kernels(a, a_scale, w_gu, s_gu, w_down, s_down, SMALL_GU, SMALL_DOWN)
    h, amax = silu_mul_rows_fp8(a, a_scale, w_gu, s_gu, config=SMALL_GU)
    product = (gate.float() * torch.sigmoid(gate.float()) * up.float()).to(BF16)
    assert torch.equal(h, product)
    assert amax.shape == (-(-inter // 8), M)
    assert torch.equal(amax.amax(0), h.float().abs().amax(-1))
    out = down_from_rows_fp8(h, amax, w_down, s_down, config=SMALL_DOWN)
    assert torch.equal(out, expected)
    assert torch.equal(gated_mlp_fp8(a, a_scale, w_gu, s_gu, w_down, s_down, SMALL_GU, SMALL_DOWN), expected)


def test_a_poisoned_row_is_nan_and_the_others_are_untouched():
    """NaN in a token's activation: its row scale is NaN as quant_rows makes it, so its output row is NaN; the other
    rows keep the three kernels' bits."""
    M, K, inter, N = 3, 64, 32, 32
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=gen).to(DEVICE).to(BF16)
    a, a_scale = quantize_fp8_rows(x, K)
    (w_gu, s_gu), (w_down, s_down) = weights(2 * inter, K, gen), weights(N, inter, gen)
    a_scale = a_scale.clone()
    a_scale[1] = float("inf")  # inf * 0-code products give NaN in row 1's gate/up sums
    expected, _, _ = three_kernels(a, a_scale, w_gu, s_gu, w_down, s_down, SMALL_GU, SMALL_DOWN)
    out = gated_mlp_fp8(a, a_scale, w_gu, s_gu, w_down, s_down, SMALL_GU, SMALL_DOWN)
    assert out[1].isnan().all() and expected[1].isnan().all()
    assert torch.equal(out[[0, 2]], expected[[0, 2]])
