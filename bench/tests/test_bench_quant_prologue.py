"""bench.quant_prologue's GEMM under the interpreter: the quantize kernel then the fp8 GEMM, bit for bit, split along
K and whole, a partial row tile, and a poisoned row."""

import pytest
import torch

from bench.quant_prologue import quant_prologue_mm
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter; bench.quant_prologue checks it on the GPU")
@pytest.mark.parametrize(("M", "N", "K"), [(1, 128, 1024), (3, 96, 512)])
def test_the_quantizer_in_the_prologue_gives_the_two_kernels_bits(M, N, K):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, M)[:, None]
    x[:, K - 3] = -2 * x.abs().amax(1)  # each row's amax from a negative value in its last chunk
    x = x.to(torch.bfloat16)
    if M > 1:
        x[1, 7] = float("nan")  # a poisoned row: NaN codes and scale, its outputs NaN, the others untouched
    w = torch.randn(N, K, generator=gen).to(torch.float8_e4m3fn)
    w_scale = torch.rand(N, 1, generator=gen) + 0.5
    want = fp8_scaled_mm(*quantize_fp8_rows(x, K), w, w_scale, None, torch.bfloat16)
    got = quant_prologue_mm(x, w, w_scale)
    assert want.abs().nan_to_num().max() > 0
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert (got[1].isnan().all() and not got[0].isnan().any()) if M > 1 else not got.isnan().any()
