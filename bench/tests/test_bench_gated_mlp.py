"""bench.gated_mlp's down tiles (wider than the fp8 GEMM's plan) give the three kernels' bits: the chain checks it
again on the GPU before it times them, and here the interpreter runs the same tiles over a column tail and a split
K."""

import pytest
import torch

from bench.gated_mlp import DOWN_128_2_WARPS, DOWN_256
from fxquant.kernels.gated_mlp_fp8 import gated_mlp_fp8
from fxquant.kernels.gemm_fp8 import _launch_plan, fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows
from fxquant.numerics import reference as R

BF16 = torch.bfloat16
GATE_UP = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, programs=8)


@pytest.mark.parametrize("down", [DOWN_256, DOWN_128_2_WARPS], ids=["256 wide", "128 wide, 2 warps"])
def test_the_wide_down_tiles_give_the_three_kernels_bits(down):
    M, K, inter, N = 3, 64, 384, 300  # N: a tile past the last column; inter: 3 K steps, in two slices
    down = {**down, "SPLIT_K": 2}
    assert _launch_plan(M, N, inter, False, False, tuple(sorted(down.items())))[1] == 2
    gen = torch.Generator().manual_seed(3)
    a, a_scale = quantize_fp8_rows((torch.randn(M, K, generator=gen) * 3).to(BF16), K)
    w_gu, w_down = (R.quantize(torch.randn(n, k, generator=gen) * 0.05, "fp8_e4m3", "channel")
                    for n, k in ((2 * inter, K), (N, inter)))
    gate, up = fp8_scaled_mm(a, a_scale, w_gu.data, w_gu.scale, None, BF16, GATE_UP).chunk(2, dim=-1)
    codes, scales = silu_mul_quantize_fp8_rows(gate, up, inter)
    expected = fp8_scaled_mm(codes, scales, w_down.data, w_down.scale, None, BF16, down)
    out = gated_mlp_fp8(a, a_scale, w_gu.data, w_gu.scale, w_down.data, w_down.scale, GATE_UP, down)
    assert torch.equal(out, expected)
