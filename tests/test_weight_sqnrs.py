"""A weight's SQNR and its worst channel's, measured a chunk of rows at a time (quantize_ and the backend's
reports): `Quantized.rows` dequantizes bit for bit as the whole tensor does, for every recipe's weight format, and
the chunked measure gives the whole-tensor fp64 numbers, for experts too."""

import math

import pytest
import torch

from fxquant.config import RECIPES
from fxquant.numerics import reference as R
from fxquant.numerics.metrics import row_sums
from fxquant.quantization import weight_quantization
from fxquant.quantization.weight_quantization import quantize_weight, weight_sqnrs

K, CHUNK = 256, 256  # chunks of 256 rows of 256 columns
ROWS = 2 * CHUNK + 128  # a last chunk shorter than the others, still whole 128-row blocks


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(weight_quantization, "CHUNK_ELEMENTS", CHUNK * K)


def whole_sqnrs(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """The whole tensor's SQNR and its lowest row's (rows of exact zeros skipped), from fp64 copies of both."""
    exact, noise = exact.double(), (approx.double() - exact.double())
    rows = exact.pow(2).sum(-1) / noise.pow(2).sum(-1)
    return float(10 * torch.log10(exact.pow(2).sum() / noise.pow(2).sum())), float(10 * torch.log10(rows.min()))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_rows_of_a_quantized_weight_dequantize_as_the_whole_does(recipe):
    w = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q = quantize_weight(w, recipe)
    whole = R.dequantize(q, torch.float32)
    for start, stop in [(0, CHUNK), (CHUNK, ROWS), (128, 384)]:
        assert torch.equal(R.dequantize(q.rows(start, stop), torch.float32), whole[start:stop]), (start, stop)


@pytest.mark.parametrize("recipe", ["fp8_block", "int4_wo", "nvfp4_wo"])
def test_the_chunked_measure_gives_the_whole_tensors_numbers(recipe):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(ROWS, K, generator=gen) * torch.logspace(-2, 1, ROWS)[:, None]  # rows of many ranges
    q = quantize_weight(w, recipe)
    got, want = weight_sqnrs(q, w), whole_sqnrs(R.dequantize(q, torch.float32), w)
    assert got == pytest.approx(want, abs=1e-9) and got[1] < got[0]
    experts = torch.randn(3, ROWS, K, generator=gen)
    q = quantize_weight(experts, recipe)
    rows = lambda t: t.reshape(-1, t.shape[-1])
    want = whole_sqnrs(rows(R.dequantize_experts(q, torch.float32)), rows(experts))
    assert weight_sqnrs(q, experts) == pytest.approx(want, abs=1e-9)


def test_a_chunk_is_whole_blocks_of_about_chunk_elements():
    assert weight_quantization.chunk_rows(K) == CHUNK and weight_quantization.chunk_rows(3 * K) == 128
    assert weight_quantization.chunk_rows(K // 2) == 2 * CHUNK


def test_zero_rows_are_skipped_and_a_non_finite_weight_measures_nan():
    w = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(2))
    w[5] = 0
    got = weight_sqnrs(quantize_weight(w, "fp8_row"), w)
    assert math.isfinite(got[1]) and got[1] <= got[0]
    w[CHUNK + 100, 3] = math.inf  # in the second chunk
    assert math.isnan(weight_sqnrs(quantize_weight(w, "fp8_row"), w)[0])


def test_row_sums_leave_the_callers_rows_as_given():
    approx, exact = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8)
    kept = approx.clone()
    signal, noise = row_sums(approx, exact)
    assert torch.equal(approx, kept)
    assert torch.equal(noise, (kept - exact.double()).square().sum(-1))
    assert torch.equal(signal, exact.double().square().sum(-1))
