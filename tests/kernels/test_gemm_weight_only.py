"""Weight-only GEMMs (Triton) against the fp64 product of the dequantized weight. int8, MXFP4, NVFP4 and MXFP8
operands are exact, so each output is off by at most one ulp of its dtype (one rounding at the store) plus the fp32
accumulation's error, bounded by (steps + log2(BLOCK_K)) * 2^-24 * sum |x w| < 2^-20 * sum |x w| at these K.
int4's codes enter the MMA as exact integers q - z and its group scale multiplies the fp32 partial sum, which
adds one rounding per group to the same bound."""

import pytest
import torch

from fxquant.kernels import gemm_weight_only
from fxquant.kernels.dequantize_weight import dequantize_weight
from fxquant.kernels.gemm_weight_only import DEQUANTIZE_ABOVE_M, _launch_plan, weight_only_mm, wo_gemm_config
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRANULARITY = {"int8": "channel", "int4": ("group", 128), "mxfp4": None, "nvfp4": None, "mxfp8": None}
GROUP = {"int8": 0, "int4": 128, "mxfp4": 32, "nvfp4": 16, "mxfp8": 32}
# mxfp8 multiplies bf16 activations only (fp16 is refused: tests/kernels/test_quant_mx.py)
FORMAT_DTYPES = [(fmt, dtype) for fmt in GRANULARITY for dtype in (torch.bfloat16, torch.float16)
                 if not (fmt == "mxfp8" and dtype == torch.float16)]
# (M, N, K): decode with split-K (K >= 1024), N and M tails, medium M with and without split-K, a large M.
SHAPES = [(1, 128, 1024), (16, 96, 1024), (5, 80, 384), (24, 96, 1024), (100, 96, 1024), (37, 128, 256),
          (200, 64, 256)]


def within_bound(out, x, w_hp, bias=None, rounded_weight=False, extra=0):
    """out within one output ulp and 2^-20 of sum |x| |w| (fp32 sums of exact products) of the fp64 product, plus
    half an ulp of the output dtype per term where the weight was rounded to it first, plus `extra` where given."""
    exact = x.double() @ w_hp.T + (0 if bias is None else bias.double())
    mant = torch.finfo(out.dtype).eps  # 2^-7 (bf16) or 2^-10 (fp16) at 1.0
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))) * mant
    sum_abs = x.double().abs() @ w_hp.abs().T
    tolerance = ulp + (2**-20 + (mant / 2 if rounded_weight else 0)) * sum_abs + extra
    return bool(((out.double() - exact).abs() <= tolerance).all())


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("fmt,dtype", FORMAT_DTYPES, ids=str)
def test_kernel_is_the_exact_product_rounded_once(fmt, dtype, shape):
    """The in-register path, also past DEQUANTIZE_ABOVE_M when given its tiles."""
    M, N, K = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=gen) * 0.05).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE)
    q = R.quantize(w, fmt, GRANULARITY[fmt]) if GRANULARITY[fmt] else R.quantize(w, fmt)
    out = weight_only_mm(x, q.data, q.scale, fmt, GROUP[fmt], N, zero_point=q.zero_point,
                         global_scale=q.global_scale, bias=bias, config=wo_gemm_config(min(M, 128), K, fmt))
    assert out.shape == (M, N) and out.dtype == dtype
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


def quantized(fmt, N, K, gen, symmetric=False):
    w = torch.randn(N, K, generator=gen) * 0.05
    if fmt == "int4":
        return R.quantize(w.to(DEVICE), fmt, GRANULARITY[fmt], symmetric=symmetric)
    return R.quantize(w.to(DEVICE), fmt, GRANULARITY[fmt]) if GRANULARITY[fmt] else R.quantize(w.to(DEVICE), fmt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("fmt,K,symmetric", [("int8", 200, False), ("int4", 384, False), ("int4", 256, True),
                                             ("mxfp4", 160, False), ("nvfp4", 400, False), ("mxfp8", 160, False)])
def test_dequantize_weight_is_the_reference_bit_for_bit(fmt, K, symmetric, dtype):
    """K tails (160, 200, 400 are not multiples of the 128-wide tile) and a row tail (N = 40)."""
    q = quantized(fmt, 40, K, torch.Generator().manual_seed(1), symmetric)
    scale = q.scale.view(torch.uint8) if fmt in ("mxfp4", "nvfp4", "mxfp8") else q.scale
    codes = {"int8": q.data, "mxfp8": q.data.view(torch.uint8)}.get(fmt, q.data.view(torch.int32))
    out = dequantize_weight(codes, scale.reshape(40, -1), fmt, GROUP[fmt], K, dtype, zero_point=q.zero_point,
                            global_scale=q.global_scale)
    assert torch.equal(out, R.dequantize(q, dtype))


@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4", "nvfp4", "mxfp8"])
def test_stacked_experts_dequantize_in_one_launch_bit_for_bit(fmt):
    """Three experts' codes [E, N, ...] as a block of their columns (a strided view, as the grouped product takes
    them), each with its own scales, zero points and NVFP4 global scale: each expert's reference weight, bit for
    bit."""
    gen = torch.Generator().manual_seed(4)
    experts = [quantized(fmt, 48, 256, gen) for _ in range(3)]
    q = R.stack_experts(experts)
    codes, scale = gemm_weight_only.weight_operands(torch.empty(1, 256, dtype=torch.bfloat16, device=DEVICE), q.data,
                                                     q.scale, fmt, GROUP[fmt], 48)
    columns = slice(16, 40)
    zero = None if q.zero_point is None else q.zero_point[:, columns]
    out = dequantize_weight(codes[:, columns], scale[:, columns], fmt, GROUP[fmt], 256, torch.bfloat16,
                            zero_point=zero, global_scale=q.global_scale)
    assert out.shape == (3, 24, 256)
    for e, expert in enumerate(experts):
        assert torch.equal(out[e], R.dequantize(expert, torch.bfloat16)[columns])


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("M", [DEQUANTIZE_ABOVE_M + 1, DEQUANTIZE_ABOVE_M + 72])
@pytest.mark.parametrize("chunk_elements", [2**26, 4 * 256], ids=["one chunk", "rows of 4"])
@pytest.mark.parametrize("fmt", list(GRANULARITY))
def test_dequantize_path_multiplies_the_rounded_weight(fmt, chunk_elements, M, with_bias, monkeypatch):
    """Past DEQUANTIZE_ABOVE_M the weight is rounded once to bf16 (half an ulp) and multiplied by torch's GEMM, in
    chunks of rows when it is large (here forced to 4 rows)."""
    monkeypatch.setattr(gemm_weight_only, "CHUNK_ELEMENTS", chunk_elements)
    gen = torch.Generator().manual_seed(2)
    N, K = 24, 256
    assert _launch_plan(M, N, K, fmt, GROUP[fmt], None) is None
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE) if with_bias else None
    q = quantized(fmt, N, K, gen)
    out = weight_only_mm(x, q.data, q.scale, fmt, GROUP[fmt], N, zero_point=q.zero_point,
                         global_scale=q.global_scale, bias=bias)
    assert out.shape == (M, N)
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias, rounded_weight=True)


@pytest.mark.parametrize("M,N,K,fmt,split", [
    (16, 4096, 4096, "int4", 8),  # decode: 64 tiles toward 1056 programs, keeping 4 K steps per slice
    (32, 4096, 14336, "int4", 4),  # 64 tiles toward 264: 27.8 us against 80.2 us dequantized (H200)
    (64, 4096, 14336, "int4", 8),  # 32 tiles: 38.4 us against 83.0 us
    (64, 14336, 4096, "mxfp4", 1),  # 224 64-wide tiles fill the SMs unsplit
    (64, 14336, 4096, "int4", 2),  # 112 tiles: 40.2 us against 80.8 us dequantized
    (128, 14336, 4096, "mxfp4", 1),  # 112 tiles of 128x128; two slices each would pass 132 programs: 55.6 us
    (128, 4096, 4096, "int8", 4),  # 32 tiles of 128x128: 19.3 us against 26.2 us dequantized
    (1, 4096, 14336, "mxfp8", 8),  # 64 tiles toward 528 programs: 26.5 us against 32.6 on int8's 264
    (DEQUANTIZE_ABOVE_M + 1, 14336, 4096, "int4", None),  # dequantized: 93 us against 138 us at M = 256
])
def test_path_choice_follows_the_measured_crossover(M, N, K, fmt, split):
    """Up to DEQUANTIZE_ABOVE_M the product runs in registers, split along K where its tiles are too few; past it
    the weight is dequantized (no plan)."""
    plan = _launch_plan(M, N, K, fmt, GROUP[fmt], None)
    assert (plan and plan[1]) == split


def test_symmetric_int4_and_no_bias():
    x = torch.randn(3, 256).to(torch.bfloat16).to(DEVICE)
    q = R.quantize(torch.randn(64, 256).to(DEVICE), "int4", ("group", 128), symmetric=True)
    out = weight_only_mm(x, q.data, q.scale, "int4", 128, 64)
    assert within_bound(out, x, R.dequantize(q, torch.float64))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_k_tail_of_packed_codes(fmt):
    """K = 160 ends mid K step: the last step's words past the row are masked, not read."""
    x = torch.randn(3, 160).to(torch.bfloat16).to(DEVICE)
    q = R.quantize((torch.randn(48, 160) * 0.05).to(DEVICE), fmt)
    out = weight_only_mm(x, q.data, q.scale, fmt, GROUP[fmt], 48, global_scale=q.global_scale)
    assert within_bound(out, x, R.dequantize(q, torch.float64))


@pytest.mark.parametrize("M", [1, 40])
def test_int4_groups_narrower_than_a_k_step_take_the_dequantize_path(M):
    """Groups of 64 under 128-wide K steps: dequantized once (any power-of-two group), within the rounded bound."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(M, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    q = R.quantize((torch.randn(48, 256, generator=gen) * 0.05).to(DEVICE), "int4", ("group", 64))
    out = weight_only_mm(x, q.data, q.scale, "int4", 64, 48, zero_point=q.zero_point)
    assert within_bound(out, x, R.dequantize(q, torch.float64), rounded_weight=True)


def test_bad_arguments_are_clear_errors():
    x = torch.randn(2, 256, dtype=torch.float32, device=DEVICE)
    q = R.quantize(torch.randn(64, 256, device=DEVICE), "int8", "channel")
    with pytest.raises(ValueError, match="bf16/fp16 activations"):
        weight_only_mm(x, q.data, q.scale, "int8", 0, 64)
    with pytest.raises(ValueError, match="weight codes must be"):
        weight_only_mm(x.bfloat16(), q.data[:, :128], q.scale, "int8", 0, 64)
    q6 = R.quantize(torch.randn(64, 192, device=DEVICE), "int4", ("group", 96))
    with pytest.raises(ValueError, match="powers of two, got 96"):
        weight_only_mm(torch.randn(2, 192, device=DEVICE, dtype=torch.bfloat16), q6.data, q6.scale, "int4", 96, 64,
                       zero_point=q6.zero_point)
    q4 = R.quantize(torch.randn(64, 16, device=DEVICE), "nvfp4")
    with pytest.raises(ValueError, match="K a multiple of 8"):
        weight_only_mm(torch.randn(2, 12, device=DEVICE, dtype=torch.bfloat16), q4.data[:, :6], q4.scale, "nvfp4",
                       16, 64)


def test_supports_names_what_the_kernels_refuse():
    """The ops take the kernels where supports() returns None and the reference elsewhere, for the reason given."""
    a = torch.empty(4, 256, dtype=torch.bfloat16, device=DEVICE)
    if DEVICE == "cpu":
        assert "CUDA" in gemm_weight_only.supports(a, "int4")
        return
    assert gemm_weight_only.supports(a, "int4") is None and gemm_weight_only.supports(a, "mxfp8") is None
    assert "not torch.float32" in gemm_weight_only.supports(a.float(), "int4")
    assert "bf16 activations" in gemm_weight_only.supports(a.half(), "mxfp8")
