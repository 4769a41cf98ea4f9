"""The int4 GEMV (Triton) against the fp64 product of the dequantized weight, with the tensor-core kernel's bound
(`test_gemm_weight_only.within_bound`): every decoded code is exact, each product rounds once, and each group's
sum is scaled once."""

import pytest
import torch

from fxquant import reference as R
from fxquant.kernels import gemm_weight_only
from fxquant.kernels.gemm_weight_only import weight_only_mm
from fxquant.kernels.gemv_weight_only import wo_gemv_config
from tests.kernels.test_gemm_weight_only import DEVICE, within_bound

# (N, K, group): split-K; an N tail with a K tail (640 ends mid step); groups of 32 and 64 (several per step);
# a group of 1024, which widens the 512-wide step.
SHAPES = [(128, 2048, 128), (80, 640, 128), (48, 512, 32), (40, 1024, 64), (32, 2048, 1024)]


def quantized(N, K, group, gen, symmetric):
    w = torch.randn(N, K, generator=gen) * 0.05
    return R.quantize(w.to(DEVICE), "int4", ("group", group), symmetric=symmetric)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("symmetric", [False, True], ids=["zero point", "symmetric"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemv_is_the_exact_product_rounded_once(shape, symmetric, dtype):
    N, K, group = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, K, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE)
    q = quantized(N, K, group, gen, symmetric)
    out = weight_only_mm(x, q.data, q.scale, "int4", group, N, zero_point=q.zero_point, bias=bias,
                         config=dict(wo_gemv_config(), programs=8))  # few programs: several K steps per slice
    assert out.shape == (1, N) and out.dtype == dtype
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


@pytest.mark.parametrize("M,fmt,group,expected", [
    (1, "int4", 128, True), (1, "int4", 32, True), (2, "int4", 128, False), (1, "int4", 16, False),
    (1, "mxfp4", 32, False), (1, "int8", 0, False),
])
def test_one_row_of_int4_takes_the_gemv(M, fmt, group, expected, monkeypatch):
    """Groups of 16 codes are narrower than the GEMV's 16-byte loads of 32; other formats and M > 1 take the tensor
    cores."""
    calls = []
    monkeypatch.setattr(gemm_weight_only, "weight_only_gemv", lambda *args: calls.append(args) or args[0])
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(64, 256, generator=gen).to(DEVICE)
    q = (R.quantize(w, fmt, ("group", group)) if fmt == "int4" else
         R.quantize(w, fmt, "channel") if fmt == "int8" else R.quantize(w, fmt))
    weight_only_mm(torch.randn(M, 256, device=DEVICE, dtype=torch.bfloat16), q.data, q.scale, fmt, group, 64,
                   zero_point=q.zero_point, global_scale=q.global_scale)
    assert bool(calls) is expected
