"""Large-M fp8 GEMMs through cuBLAS: the call shapes the installed torch accepts (meta tensors, any machine), which
products it takes, and its error against the fp64 product of the dequantized operands (bf16 output: about 2^-9
relative per element, so 4e-3 on the norm)."""

import pytest
import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant import reference as R
from fxquant.kernels.cublas_fp8 import CUBLAS_ABOVE_M, cublas_scaled_mm, cublas_takes
from fxquant.kernels.gemm_fp8 import is_block_scaled

RECIPES = {"tensor": ("tensor", "tensor"), "row": ("token", "channel"), "block": (("group", 128), ("block", 128, 128))}


def operands(recipe, M=CUBLAS_ABOVE_M + 128, N=384, K=512):
    ga, gw = RECIPES[recipe]
    gen = torch.Generator(device="cuda").manual_seed(0)
    qa = R.quantize(torch.randn(M, K, device="cuda", generator=gen), "fp8_e4m3", ga)
    qw = R.quantize(torch.randn(N, K, device="cuda", generator=gen) * 0.05, "fp8_e4m3", gw)
    a_scale = qa.scale.reshape(1) if qa.scale.numel() == 1 else qa.scale
    return qa, qw, a_scale


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_installed_torch_accepts_the_call_shapes(recipe):
    """torch._scaled_mm's shape and layout checks run on meta tensors: an API change in torch fails here, on CPU."""
    M, N, K = CUBLAS_ABOVE_M + 128, 384, 512
    e4m3 = dict(dtype=torch.float8_e4m3fn, device="meta")
    scales = {"tensor": ((1,), (1,)), "row": ((M, 1), (N, 1)), "block": ((M, K // 128), (N // 128, K // 128))}
    a_scale, w_scale = (torch.empty(shape, device="meta") for shape in scales[recipe])
    out = cublas_scaled_mm(torch.empty(M, K, **e4m3), a_scale, torch.empty(N, K, **e4m3), w_scale, recipe == "block")
    assert out.shape == (M, N) and out.dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_op_at_large_m_matches_the_exact_product(recipe):
    qa, qw, a_scale = operands(recipe)
    assert cublas_takes(qa.data, a_scale, qw.data, qw.scale, None, torch.bfloat16,
                        is_block_scaled(a_scale, qw.scale, qw.shape[0]))
    out = torch.ops.fxquant.scaled_mm_fp8(qa.data, a_scale, qw.data, qw.scale, None, torch.bfloat16)
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
    assert float((out.double() - exact).norm() / exact.norm()) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bias", "fp32 out", "decode M", "unaligned N"])
def test_other_products_stay_on_the_triton_kernel(case):
    # Block weights tile N in 128s, so the unaligned-N case uses row scales (cuBLAS needs N % 16 == 0 there).
    recipe = "row" if case == "unaligned N" else "block"
    qa, qw, a_scale = operands(recipe, M=16 if case == "decode M" else CUBLAS_ABOVE_M + 128,
                               N=328 if case == "unaligned N" else 384)
    bias = torch.randn(qw.shape[0], device="cuda", dtype=torch.bfloat16) if case == "bias" else None
    out_dtype = torch.float32 if case == "fp32 out" else torch.bfloat16
    assert not cublas_takes(qa.data, a_scale, qw.data, qw.scale, bias, out_dtype,
                            is_block_scaled(a_scale, qw.scale, qw.shape[0]))
    out = torch.ops.fxquant.scaled_mm_fp8(qa.data, a_scale, qw.data, qw.scale, bias, out_dtype)
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
    if bias is not None:
        exact += bias.double()
    assert float((out.double() - exact).norm() / exact.norm()) < 4e-3
