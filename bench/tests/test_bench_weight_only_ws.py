"""bench.weight_only_ws's probe GEMM under the interpreter: the exact product of `dequantize_weight`'s bf16 values,
rounded once, over a partial row tile and several groups."""

import pytest
import torch

from bench.weight_only_ws import half_order, int4_ws_mm, transposed_scales
from fxquant.numerics import reference as R
from tests.kernels.test_gemm_weight_only import within_bound


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter; bench.weight_only_ws checks it on the GPU")
@pytest.mark.parametrize("M", [40, 128])
def test_the_tiled_product_multiplies_the_weight_dequantize_weight_writes(M):
    gen = torch.Generator().manual_seed(0)
    N, K = 256, 384
    q = R.quantize(torch.randn(N, K, generator=gen) * 0.05, "int4", ("group", 128))
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    out = int4_ws_mm(x, half_order(q.data), *transposed_scales(q.scale, q.zero_point))
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert within_bound(out, x, R.dequantize(q, torch.bfloat16).double())  # the bf16 weight's exact product
    assert not within_bound(out, x, R.dequantize(q, torch.bfloat16).double().roll(1, 0))  # a row off: fails
