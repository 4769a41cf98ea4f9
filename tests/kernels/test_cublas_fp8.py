"""Large-M fp8 GEMMs through cuBLAS: the call shapes the installed torch accepts (meta tensors, any machine), which
products it takes, and its error against the fp64 product of the dequantized operands (bf16 output: about 2^-9
relative per element, so 4e-3 on the norm)."""

import pytest
import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.cublas_fp8 import CUBLAS_ABOVE_M, block_scaled_rows, cublas_scaled_mm, supports
from fxquant.kernels.gemm_fp8 import is_block_scaled
from fxquant.numerics import reference as R

RECIPES = {"tensor": ("tensor", "tensor"), "row": ("token", "channel"), "block": (("group", 128), ("block", 128, 128))}


def operands(recipe, M=CUBLAS_ABOVE_M + 128, N=384, K=512):
    ga, gw = RECIPES[recipe]
    gen = torch.Generator(device="cuda").manual_seed(0)
    qa = R.quantize(torch.randn(M, K, device="cuda", generator=gen), "fp8_e4m3", ga)
    qw = R.quantize(torch.randn(N, K, device="cuda", generator=gen) * 0.05, "fp8_e4m3", gw)
    a_scale = qa.scale.reshape(1) if qa.scale.numel() == 1 else qa.scale
    return qa, qw, a_scale


def meta_operands(recipe, M=CUBLAS_ABOVE_M + 128, N=384, K=512, a_group=128):
    e4m3 = dict(dtype=torch.float8_e4m3fn, device="meta")
    scales = {"tensor": ((1,), (1,)), "row": ((M, 1), (N, 1)), "block": ((M, K // a_group), (N // 128, K // 128))}
    a_scale, w_scale = (torch.empty(shape, device="meta") for shape in scales[recipe])
    return torch.empty(M, K, **e4m3), a_scale, torch.empty(N, K, **e4m3), w_scale


@pytest.mark.parametrize("M", [CUBLAS_ABOVE_M + 128, 1001], ids=["M 256", "M 1001"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_installed_torch_accepts_the_call_shapes(recipe, M):
    """torch._scaled_mm's shape and layout checks run on meta tensors: an API change in torch fails here, on CPU."""
    a, a_scale, w, w_scale = meta_operands(recipe, M=M)
    assert supports(a, a_scale, w, w_scale, None, torch.bfloat16, recipe == "block") is None
    out = cublas_scaled_mm(a, a_scale, w, w_scale, recipe == "block")
    assert out.shape == (a.shape[0], w.shape[0]) and out.dtype == torch.bfloat16


def test_block_scaled_rows_pad_with_zeros_of_scale_one_in_an_outer_major_grid():
    """1001 rows become 1008: the first 1001 are a's codes and scales, the rest zero codes of scale 1; the grid is
    [rows, K/128] with each group's scales contiguous (cuBLAS's outer-dimension-major layout)."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(1001, 256, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(1001, 2, generator=gen) + 0.5
    padded, grid = block_scaled_rows(a, scale)
    assert padded.shape == (1008, 256) and grid.shape == (1008, 2) and grid.stride() == (1, 1008)
    assert torch.equal(padded[:1001].view(torch.uint8), a.view(torch.uint8))
    assert not padded[1001:].view(torch.uint8).any()
    assert torch.equal(grid[:1001], scale) and bool((grid[1001:] == 1).all())
    same, grid16 = block_scaled_rows(a[:992], scale[:992])  # a multiple of 16: no copy of a
    assert same.data_ptr() == a.data_ptr() and grid16.stride() == (1, 992)


@pytest.mark.parametrize("case, reason", [
    ("bias", "a bias"), ("fp32 out", "other than bf16"), ("decode M", "M = 16"), ("unaligned N", "N = 328"),
    ("1x64 groups", "not per tensor, token and channel, or blocks"), ("fp8 e5m2", "torch.float8_e5m2")])
def test_other_products_are_left_to_the_triton_kernel_and_say_why(case, reason):
    recipe = "row" if case == "unaligned N" else "block"  # block weights tile N in 128s
    a, a_scale, w, w_scale = meta_operands(recipe, M=16 if case == "decode M" else CUBLAS_ABOVE_M + 128,
                                           N=328 if case == "unaligned N" else 384,
                                           a_group=64 if case == "1x64 groups" else 128)
    if case == "fp8 e5m2":
        a, w = a.to(torch.float8_e5m2), w.to(torch.float8_e5m2)
    bias = torch.empty(w.shape[0], device="meta") if case == "bias" else None
    out_dtype = torch.float32 if case == "fp32 out" else torch.bfloat16
    assert reason in supports(a, a_scale, w, w_scale, bias, out_dtype, recipe == "block")


def test_wide_weights_go_to_cublas_from_m_128_and_narrow_ones_above_it():
    """Measured crossovers: at M = 128 cuBLAS wins on weights of more than 8192 rows, the Triton kernel on others."""
    takes = lambda M, N: supports(*meta_operands("block", M=M, N=N, K=512), None, torch.bfloat16, True) is None
    assert takes(128, 8320) and not takes(64, 8320) and not takes(127, 8320)
    assert not takes(128, 8192) and takes(CUBLAS_ABOVE_M + 1, 8192)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [CUBLAS_ABOVE_M + 128, 1001], ids=["M 256", "M 1001"])  # 1001: rows padded
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_op_at_large_m_matches_the_exact_product(recipe, M):
    qa, qw, a_scale = operands(recipe, M=M)
    assert supports(qa.data, a_scale, qw.data, qw.scale, None, torch.bfloat16,
                    is_block_scaled(a_scale, qw.scale, qw.shape[0])) is None
    out = torch.ops.fxquant.scaled_mm_fp8(qa.data, a_scale, qw.data, qw.scale, None, torch.bfloat16)
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
    assert float((out.double() - exact).norm() / exact.norm()) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bias", "fp32 out", "decode M", "unaligned N"])
def test_products_left_to_the_triton_kernel_match_the_exact_product(case):
    recipe = "row" if case == "unaligned N" else "block"
    qa, qw, a_scale = operands(recipe, M=16 if case == "decode M" else CUBLAS_ABOVE_M + 128,
                               N=328 if case == "unaligned N" else 384)
    bias = torch.randn(qw.shape[0], device="cuda", dtype=torch.bfloat16) if case == "bias" else None
    out_dtype = torch.float32 if case == "fp32 out" else torch.bfloat16
    out = torch.ops.fxquant.scaled_mm_fp8(qa.data, a_scale, qw.data, qw.scale, bias, out_dtype)
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
    if bias is not None:
        exact += bias.double()
    assert float((out.double() - exact).norm() / exact.norm()) < 4e-3


@pytest.mark.gpu
def test_malformed_block_scales_get_the_triton_kernels_error():
    """1x64 activation groups under 128x128 weight blocks: not sent to cuBLAS, refused with the fix."""
    qa = R.quantize(torch.randn(CUBLAS_ABOVE_M + 128, 512, device="cuda"), "fp8_e4m3", ("group", 64))
    qw = R.quantize(torch.randn(384, 512, device="cuda") * 0.05, "fp8_e4m3", ("block", 128, 128))
    with pytest.raises(ValueError, match="block-scaled fp8 GEMM needs a_scale"):
        torch.ops.fxquant.scaled_mm_fp8(qa.data, qa.scale, qw.data, qw.scale, None, torch.bfloat16)
