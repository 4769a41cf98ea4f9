"""MXFP8 activations as bf16 values (Triton) against the reference quantize -> dequantize, bit for bit, and the MX
product they make with the weight-only GEMM against the reference MX GEMM."""

import pytest
import torch

from fxquant.kernels.gemm_weight_only import weight_only_mm, wo_gemm_config
from fxquant.kernels.quant_mx import mxfp8_values
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def blocks_of_every_scale(shape, dtype, seed=0):
    """Random blocks of 32 whose magnitudes span 2^-40 .. 2^40 (clamped E8M0 exponents at the bottom for fp32),
    with an all-zero block, a NaN block, an inf block and a block at e4m3's saturation edge."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    blocks = x.reshape(-1, 32)
    blocks *= torch.exp2(torch.randint(-40, 40, (blocks.shape[0], 1), generator=gen).float())
    blocks[0] = 0.0
    blocks[1, 3] = float("nan")
    blocks[2, 7] = float("-inf")
    blocks[3] = torch.linspace(-460.0, 460.0, 32)  # amax 460: floor(log2) - 8 = 0, so 449..460 saturate to 448
    if dtype == torch.float32:
        blocks[4] = torch.randn(32, generator=gen) * 1e-40  # fp32 subnormals: scale 2^-127, bf16 subnormal values
    return x.to(dtype).to(DEVICE)


def same(a, b):
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.view(torch.int16)[~a.isnan()],
                                                             b.view(torch.int16)[~b.isnan()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", [(8, 32), (3, 7, 96), (300, 160)], ids=str)
def test_values_are_the_reference_bit_for_bit(shape, dtype):
    x = blocks_of_every_scale(shape, dtype)
    out = mxfp8_values(x)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert same(out, R.dequantize(R.quantize(x, "mxfp8"), torch.bfloat16))
    assert out.reshape(-1, 32)[1].isnan().all() and out.reshape(-1, 32)[2].isnan().all()  # poisoned blocks


def test_last_dim_must_hold_whole_blocks():
    with pytest.raises(ValueError, match="multiple of 32, got 48"):
        mxfp8_values(torch.randn(2, 48, device=DEVICE))


@pytest.mark.parametrize("M", [1, 40, 200])
def test_mx_product_through_bf16_values_is_the_reference_mx_gemm(M):
    """Both operands enter the MMA exactly, so against the fp64 product of the dequantized MX operands each output
    is off by its one bf16 rounding plus the fp32 accumulation's error (2^-20 of sum |x w| at this K). M = 200 takes
    its tiles explicitly here: on the GPU it dequantizes the weight for cuBLAS, which accumulates in fp32 too."""
    gen = torch.Generator().manual_seed(1)
    N, K = 96, 384
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    qw = R.quantize((torch.randn(N, K, generator=gen) * 0.05).to(DEVICE), "mxfp8")
    out = weight_only_mm(mxfp8_values(x), qw.data, qw.scale, "mxfp8", 32, N, bias=bias,
                         config=wo_gemm_config(min(M, 128), K, "mxfp8"))
    xq, wq = (R.dequantize(q, torch.float64) for q in (R.quantize(x, "mxfp8"), qw))
    exact = xq @ wq.T + bias.double()
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))) * 2**-7
    assert bool(((out.double() - exact).abs() <= ulp + 2**-20 * (xq.abs() @ wq.abs().T)).all())


def test_fp16_activations_are_refused_with_the_fix():
    qw = R.quantize(torch.randn(64, 64, device=DEVICE), "mxfp8")
    with pytest.raises(ValueError, match="MXFP8's range; got torch.float16: cast the activations to bf16"):
        weight_only_mm(torch.randn(2, 64, device=DEVICE, dtype=torch.float16), qw.data, qw.scale, "mxfp8", 32, 64)
