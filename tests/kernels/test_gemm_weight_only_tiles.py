"""The weight-only GEMM that dequantizes its weight tile by tile (past decode's M, under `prefill_in_tiles`) against
the fp64 product of the reference weight rounded to the activations' dtype, which is what it multiplies: each output
is off by at most one ulp (the store's rounding) plus the fp32 accumulation's error, < 2^-20 * sum |x w| at these K,
with none of the dequantized weight's own rounding allowed for (tests/kernels/test_gemm_weight_only.py's bound)."""

import pytest
import torch

from fxquant.kernels import gemm_grouped, gemm_weight_only
from fxquant.kernels.gemm_grouped import grouped_weight_only_mm
from fxquant.kernels.gemm_weight_only import DEQUANTIZE_ABOVE_M, weight_only_mm, weight_operands
from fxquant.kernels.gemm_weight_only_tiles import prefill_in_tiles, tiles_config, weight_only_tiles_mm
from fxquant.numerics import reference as R
from tests.kernels.test_gemm_weight_only import DEVICE, FORMAT_DTYPES, GROUP, quantized, within_bound

SMALL = dict(BLOCK_N=32, BLOCK_M=32, BLOCK_K=64, GROUP_N=2, num_warps=4, num_stages=2)
# (M, N, K): row and column tails, and a K tail for the formats whose K allows one (int4's is a multiple of its group)
K_TAIL = {"int4": 256, "int8": 200, "mxfp4": 160, "nvfp4": 400, "mxfp8": 160}
CASES = [(fmt, dtype, shape) for fmt, dtype in FORMAT_DTYPES for shape in [(70, 40, 384), (33, 72, K_TAIL[fmt])]]


def product(fmt, dtype, M, N, K, seed, bias=True, config=SMALL):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    q = quantized(fmt, N, K, gen)
    b = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if bias else None
    codes, scale = weight_operands(x, q.data, q.scale, fmt, GROUP[fmt], N)
    out = weight_only_tiles_mm(x, codes, scale, fmt, GROUP[fmt], N, q.zero_point, q.global_scale, b, config)
    return out, x, q, b


@pytest.mark.parametrize("fmt,dtype,shape", CASES, ids=str)
def test_tiles_multiply_the_weight_dequantize_weight_writes(fmt, dtype, shape):
    out, x, q, bias = product(fmt, dtype, *shape, seed=3)
    assert out.shape == (shape[0], shape[1]) and out.dtype == dtype
    assert within_bound(out, x, R.dequantize(q, dtype).double(), bias)


@pytest.mark.parametrize("block_k", [64, 32], ids=["K step 64", "K step 32"])
@pytest.mark.parametrize("fmt,dtype", FORMAT_DTYPES, ids=str)
def test_the_operand_is_the_reference_weight_bit_for_bit(fmt, dtype, block_k):
    """Activations the identity: each output is one weight, exactly, so the product hands back W.T, which must be
    the reference weight rounded once to the activations' dtype, bit for bit (a weight left in fp32, or one scale
    read for the wrong K step, fails here where the bound above could let it pass)."""
    K = 256
    q = quantized(fmt, 40, K, torch.Generator().manual_seed(8))
    x = torch.eye(K, dtype=dtype, device=DEVICE)
    codes, scale = weight_operands(x, q.data, q.scale, fmt, GROUP[fmt], 40)
    out = weight_only_tiles_mm(x, codes, scale, fmt, GROUP[fmt], 40, q.zero_point, q.global_scale,
                               config={**SMALL, "BLOCK_K": block_k})
    assert torch.equal(out, R.dequantize(q, dtype).T)


@pytest.mark.parametrize("symmetric", [False, True], ids=["zero point", "symmetric"])
def test_int4_k_steps_narrower_than_the_group(symmetric):
    """BLOCK_K 32 against groups of 128: four steps under one scale, each reading its group's."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(40, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = quantized("int4", 48, 256, gen, symmetric)
    codes, scale = weight_operands(x, q.data, q.scale, "int4", 128, 48)
    out = weight_only_tiles_mm(x, codes, scale, "int4", 128, 48, q.zero_point, config={**SMALL, "BLOCK_K": 32})
    assert within_bound(out, x, R.dequantize(q, torch.bfloat16).double())


def test_the_default_tiles_with_tails():
    """tiles_config's own 128 x 256 x 64 tiles over a product smaller than one tile on every side but K."""
    M = DEQUANTIZE_ABOVE_M + 3
    assert tiles_config(M)["BLOCK_M"] == 256
    out, x, q, bias = product("int4", torch.bfloat16, M, 40, 256, seed=6, config=None)
    assert within_bound(out, x, R.dequantize(q, torch.bfloat16).double(), bias)


def test_weight_only_mm_takes_the_tiles_inside_the_switch_only(monkeypatch):
    """Past DEQUANTIZE_ABOVE_M, under prefill_in_tiles(True), no dequantized weight is written."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(DEQUANTIZE_ABOVE_M + 1, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = quantized("mxfp4", 24, 256, gen)
    calls = []
    monkeypatch.setattr(gemm_weight_only, "_dequantized_mm", lambda *args: calls.append(args) or None)
    with prefill_in_tiles(True):
        out = weight_only_mm(x, q.data, q.scale, "mxfp4", 32, 24)
    assert not calls and within_bound(out, x, R.dequantize(q, torch.bfloat16).double())
    weight_only_mm(x, q.data, q.scale, "mxfp4", 32, 24)
    assert len(calls) == 1


@pytest.mark.parametrize("fmt,dtype", [(fmt, torch.bfloat16) for fmt in GROUP] + [("int4", torch.float16)], ids=str)
def test_experts_past_128_rows_take_the_tiles_inside_the_switch(fmt, dtype, monkeypatch):
    """Rows sorted by expert, past DEQUANTIZE_ABOVE_M an active expert (570 over 4, one of them empty), and rows no
    expert owns: each expert's rows are its rounded weight's exact product within the bound, the rest zero, and no
    dequantized weight is written. fp16 too, which torch._grouped_mm does not take."""
    monkeypatch.setattr(gemm_grouped, "_grouped_dequantized_mm", lambda *args: pytest.fail("dequantized"))
    gen = torch.Generator().manual_seed(9)
    counts, N, K = [300, 0, 180, 90], 72, 256
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    x = torch.randn(sum(counts) + 7, K, generator=gen).to(dtype).to(DEVICE)
    q = R.stack_experts([quantized(fmt, N, K, gen) for _ in counts])
    with prefill_in_tiles(True):
        got = grouped_weight_only_mm(x, offs, q.data, q.scale, fmt, GROUP[fmt], N, zero_point=q.zero_point,
                                     global_scale=q.global_scale)
    assert got.shape == (x.shape[0], N) and got.dtype == dtype
    assert torch.equal(got[sum(counts):], torch.zeros_like(got[sum(counts):]))
    for e, rows in R.expert_rows(offs.cpu()):
        assert within_bound(got[rows], x[rows], R.dequantize(R.expert(q, e), dtype).double())
