"""bench.weight_only_ws's probe GEMM under the interpreter: the exact product of `dequantize_weight`'s bf16 values,
rounded once, over a partial row tile and several groups."""

import pytest
import torch

from bench.weight_only_ws import disagreement, half_order, int4_ws_mm, transposed_scales
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


def test_a_disagreement_names_the_half_of_the_weight_tile_it_lies_in():
    routed = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
    assert disagreement(routed + 1e-4, routed, 128) is None  # within 1e-2 of the largest output
    off = routed.clone()
    off[:, 128 + 70] = float("nan")  # the second tile's rows 70 and 100: its second half
    off[2, 128 + 100] += 1.0
    off[3, 256 + 5] += 1.0  # the third tile's row 5: its first half
    said = disagreement(off, routed, 128)
    assert "1 of the first half, 2 of the second" in said and "NaN" in said
