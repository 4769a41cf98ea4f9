"""fp8 activation quantizers (Triton) against the reference, bit for bit."""

import pytest
import torch
from fp8_cases import same_bits

import fxquant
from fxquant.kernels import quant_fp8
from fxquant.kernels.quant_fp8 import quantize_fp8_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMTS = ["fp8_e4m3", "fp8_e5m2"]
# Shapes hit every branch: single row, rows not filling a tile, K not a power of two, 3-D input.
SHAPES = [(1, 128), (3, 384), (17, 256), (2, 5, 640)]


def check_same(ours, ref):
    assert ours.data.dtype == ref.data.dtype and ours.data.shape == ref.data.shape
    assert same_bits(ours.data, ref.data) == 0
    assert ours.scale.shape == ref.scale.shape
    assert torch.equal(ours.scale.nan_to_num(-1.0), ref.scale.nan_to_num(-1.0))


def sample(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape[:-1] + (1,), generator=gen))
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("gran", ["token", ("group", 128), "tensor"], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_matches_reference(fmt, gran, shape):
    x = sample(shape)
    check_same(fxquant.quantize(x, fmt, gran, impl="triton"), fxquant.quantize(x, fmt, gran, impl="reference"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    x = sample((4, 256), dtype)
    for gran in ["token", ("group", 128)]:
        check_same(fxquant.quantize(x, "fp8_e4m3", gran, impl="triton"),
                   fxquant.quantize(x, "fp8_e4m3", gran, impl="reference"))


@pytest.mark.parametrize("gran", ["token", ("group", 128)], ids=str)
def test_poison_zeros_and_saturation(gran):
    x = sample((6, 256))
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    x[2] = 0.0
    x[3, :128] = 0.0
    ours = fxquant.quantize(x, "fp8_e4m3", gran, impl="triton")
    check_same(ours, fxquant.quantize(x, "fp8_e4m3", gran, impl="reference"))
    out = fxquant.dequantize(ours)
    assert torch.isnan(out[0, :128]).all() and torch.isnan(out[1, 128:]).all()
    assert torch.equal(out[2], torch.zeros(256, device=DEVICE))
    assert torch.isfinite(out[3:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("poison", [None, "nan", "inf", "zeros"])
def test_dynamic_tensor_scale_over_many_partials(poison, dtype, monkeypatch):
    """The amax pass's programs stride over the tensor (here 3 programs over 20 blocks) and every quantize program
    reduces their partials; a NaN or inf in the last block still poisons the whole tensor, and zeros get the
    floor scale."""
    monkeypatch.setattr(quant_fp8, "MAX_AMAX_PROGRAMS", 3)
    monkeypatch.setattr(quant_fp8, "TENSOR_BLOCK", 128)
    x = sample((10, 256), dtype, seed=1)
    if poison == "zeros":
        x.zero_()
    elif poison:
        x[9, 250] = float(poison)
    ours = fxquant.quantize(x, "fp8_e4m3", "tensor", impl="triton")
    check_same(ours, fxquant.quantize(x, "fp8_e4m3", "tensor", impl="reference"))
    assert ours.scale.shape == () and bool(ours.scale.isnan()) == (poison in ("nan", "inf"))


def test_non_contiguous_input():
    x = sample((256, 6)).T  # [6, 256], transposed storage
    check_same(fxquant.quantize(x, "fp8_e4m3", ("group", 128), impl="triton"),
               fxquant.quantize(x, "fp8_e4m3", ("group", 128), impl="reference"))


def test_empty_rows():
    x = torch.empty(0, 256, device=DEVICE)
    q = fxquant.quantize(x, "fp8_e4m3", "token", impl="triton")
    assert q.data.shape == (0, 256) and q.scale.shape == (0, 1)
    check_same(fxquant.quantize(x, "fp8_e4m3", "tensor", impl="triton"),
               fxquant.quantize(x, "fp8_e4m3", "tensor", impl="reference"))


def test_unsupported_request_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="no Triton quantize kernel for mxfp4"):
        fxquant.quantize(sample((2, 64)), "mxfp4", impl="triton")
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        fxquant.quantize(sample((2, 96)), "fp8_e4m3", ("group", 128), impl="triton")
    for row_len, dtype in [(96, torch.float8_e4m3fn), (128, torch.bfloat16)]:  # the launcher called directly
        with pytest.raises(ValueError, match="fp8 row quantizer needs an fp8 dtype and row_len"):
            quantize_fp8_rows(sample((2, 256)), row_len, dtype)


@pytest.mark.gpu
def test_auto_uses_the_kernel_on_cuda_and_matches_reference():
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    check_same(fxquant.quantize(x, "fp8_e4m3", ("group", 128)),
               fxquant.quantize(x, "fp8_e4m3", ("group", 128), impl="reference"))


def test_supports_rows_names_what_the_row_kernel_refuses():
    x = torch.empty(2, 256, dtype=torch.bfloat16, device=DEVICE)
    if DEVICE == "cpu":
        assert "CUDA" in quant_fp8.supports_rows(x, 256)
        return
    assert quant_fp8.supports_rows(x, 256) is None
    assert f"past its {quant_fp8.MAX_ROW_LEN}" in quant_fp8.supports_rows(x, 2 * quant_fp8.MAX_ROW_LEN)
