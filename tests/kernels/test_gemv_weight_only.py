"""The weight-only GEMV (Triton) against the fp64 product of the dequantized weight, with the tensor-core kernel's
bound (`test_gemm_weight_only.within_bound`): every decoded code is exact, products are summed in fp32, and int4's
group scale multiplies each group's exact-integer sum once."""

import pytest
import torch

from fxquant import reference as R
from fxquant.kernels import gemm_weight_only
from fxquant.kernels.gemm_weight_only import weight_only_mm
from fxquant.kernels.gemv_weight_only import GEMV_MAX_M, wo_gemv_config
from tests.kernels.test_gemm_weight_only import DEVICE, GRANULARITY, GROUP, within_bound

# (M, N, K): split-K, an N tail with a K tail (384 is one and a half 256-wide steps), the widest M, a 512-wide row.
SHAPES = [(1, 128, 1024), (3, 80, 384), (GEMV_MAX_M, 64, 256), (2, 40, 512)]
CASES = [(fmt, False) for fmt in GRANULARITY] + [("int4", True)]


def quantized(fmt, N, K, gen, symmetric, granularity=None):
    w = torch.randn(N, K, generator=gen) * 0.05
    granularity = granularity or GRANULARITY[fmt]
    if fmt == "int4":
        return R.quantize(w.to(DEVICE), fmt, granularity, symmetric=symmetric)
    return R.quantize(w.to(DEVICE), fmt, granularity) if granularity else R.quantize(w.to(DEVICE), fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt,symmetric", CASES, ids=lambda v: {True: "symmetric", False: ""}.get(v, v))
def test_gemv_is_the_exact_product_rounded_once(fmt, symmetric, shape, dtype):
    M, N, K = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE)
    q = quantized(fmt, N, K, gen, symmetric)
    out = weight_only_mm(x, q.data, q.scale, fmt, GROUP[fmt], N, zero_point=q.zero_point,
                         global_scale=q.global_scale, bias=bias)
    assert out.shape == (M, N) and out.dtype == dtype
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


@pytest.mark.parametrize("group", [64, 512])
def test_int4_groups_narrower_and_wider_than_a_k_step(group):
    """Two groups per 128-wide step, and a 512-wide group that widens the step to 512."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = quantized("int4", 48, 1024, gen, False, ("group", group))
    out = weight_only_mm(x, q.data, q.scale, "int4", group, 48, zero_point=q.zero_point,
                         config=dict(wo_gemv_config("int4"), BLOCK_K=128))
    assert within_bound(out, x, R.dequantize(q, torch.float64))


def test_small_m_takes_the_gemv_and_larger_m_the_tensor_cores(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm_weight_only, "weight_only_gemv", lambda *args: calls.append(args[0].shape[0]))
    q = quantized("int4", 64, 256, torch.Generator().manual_seed(4), False)
    for m in (1, GEMV_MAX_M, GEMV_MAX_M + 1):
        weight_only_mm(torch.randn(m, 256, device=DEVICE, dtype=torch.bfloat16), q.data, q.scale, "int4", 128, 64,
                       zero_point=q.zero_point)
    assert calls == [1, GEMV_MAX_M]
