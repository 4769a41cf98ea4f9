"""bench.weight_only_chunks' route at small shapes: the weight dequantized in chunks of rows gives the one-chunk
product bit for bit (each output column is one chunk's cuBLAS dot over the whole K), and the product is the
dequantized weight's, within bf16's rounding."""

import pytest
import torch

from bench.weight_only_chunks import GROUP, chunked_mm
from fxquant.kernels.code_tiles import tile_codes
from fxquant.numerics import reference as R
from tests.kernels.test_gemm_weight_only import within_bound

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("chunk_log", [15, 16])  # 2**15 / 256 = 128 rows: two 64-row tiles a chunk, of four
def test_chunks_of_rows_give_the_one_chunk_product(chunk_log):
    torch.manual_seed(0)
    N, K, M = 256, 256, 40
    q = R.quantize(torch.randn(N, K, device=DEVICE) * 0.02, "int4", ("group", GROUP))
    weight = (tile_codes(q.data), q.scale, q.zero_point)
    x = torch.randn(M, K, device=DEVICE).to(torch.bfloat16)
    whole = chunked_mm(x, weight, 2**27)
    assert torch.equal(chunked_mm(x, weight, 2**chunk_log), whole)
    exact = R.dequantize(q, torch.bfloat16).double()
    assert within_bound(whole, x, exact)
    assert not within_bound(whole, x, exact.roll(1, 0))  # a row off: fails
