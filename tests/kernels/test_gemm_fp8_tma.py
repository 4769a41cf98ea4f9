"""The persistent TMA fp8 GEMM against the fp64 product of the dequantized operands, and when it is taken."""

import pytest
import torch

from fxquant.kernels import gemm_fp8
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_fp8_tma import describable
from tests.kernels.test_gemm_fp8 import DEVICE, FP32_BOUND, SCHEMES, operands, rel_err

# Small tiles, so the interpreter's few programs each walk several tiles of the persistent loop.
SMALL = dict(TMA=True, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=3)
# M, N, K with tails in every dimension where the scheme allows them (block scales need N, K % 128 == 0).
SHAPES = [(37, 384, 256), (130, 256, 512), (40, 200, 176)]


@pytest.fixture
def launches(monkeypatch):
    """Counts the TMA kernel's launches."""
    calls = []
    real = gemm_fp8.launch_tma
    monkeypatch.setattr(gemm_fp8, "launch_tma", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M, N, K", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_tma_gemm_matches_fp64_product(M, N, K, scheme, out_dtype, launches):
    if scheme == "block" and (N % 128 or K % 128):
        pytest.skip("block scales need N and K multiples of 128 (the granularity refuses others)")
    qa, qw = operands(M, N, K, scheme)
    bias = torch.randn(N, device=DEVICE)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, out_dtype, SMALL)
    assert launches == [1]
    assert out.dtype == out_dtype and out.shape == (M, N)
    # The same bounds as the pointer kernel: fp32 accumulation, plus bf16's own rounding (2**-9 relative).
    assert rel_err(out, qa, qw, bias) < (FP32_BOUND if out_dtype == torch.float32 else 4e-3)


def test_operands_a_descriptor_cannot_read_take_the_pointer_kernel(launches):
    qa, qw = operands(40, 256, 264, "row")
    a = qa.data[:, 8:]  # a view whose rows start 8 bytes into each 264-byte row: not 16-byte aligned
    assert not describable(a, qw.data[:, 8:])
    bias = torch.zeros(256, device=DEVICE)
    out = fp8_scaled_mm(a, qa.scale, qw.data[:, 8:], qw.scale, bias, torch.float32, SMALL)
    assert launches == []
    exact = (a.double() * qa.scale.double()) @ (qw.data[:, 8:].double() * qw.scale.double()).T
    assert float((out.double() - exact).norm() / exact.norm()) < FP32_BOUND


@pytest.mark.parametrize("scheme", ["block", "row"])
def test_past_m_128_the_default_config_takes_the_tma_kernel_when_descriptors_can_read(scheme, launches):
    M, N, K = 200, 256, 384
    qa, qw = operands(M, N, K, scheme)
    bias = torch.randn(N, device=DEVICE)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32)
    assert launches == [1]
    assert rel_err(out, qa, qw, bias) < FP32_BOUND
    # The same product on operand copies padded by 8 bytes per row: the pointer kernel's tiles, the same result.
    pad = lambda t: torch.nn.functional.pad(t.view(torch.uint8), (0, 8)).view(t.dtype)[:, :K]
    qa_rows, qw_rows = pad(qa.data), pad(qw.data)
    assert not describable(qa_rows, qw_rows)
    out_pointer = fp8_scaled_mm(qa_rows, qa.scale, qw_rows, qw.scale, bias, torch.float32)
    assert launches == [1]
    assert rel_err(out_pointer, qa, qw, bias) < FP32_BOUND


def test_describable_needs_contiguous_16_byte_aligned_rows():
    t = torch.zeros(64, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    assert describable(t, t)
    assert not describable(t.t(), t)  # K strided
    assert not describable(t, t[:, 4:])  # unaligned start
    assert not describable(torch.zeros(64, 200, dtype=torch.float8_e4m3fn, device=DEVICE)[:, :8], t)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["block", "row"])
def test_tma_gemm_at_llama_shapes_on_the_gpu(scheme, launches):
    """Hopper tiles (128 x 128, 8 warps, deep pipeline) on a Llama projection, tails in M."""
    qa, qw = operands(1000, 4096, 4096, scheme)
    cfg = dict(TMA=True, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.float32, cfg)
    assert launches == ([1] if torch.cuda.get_device_capability() >= (9, 0) else [])
    assert rel_err(out, qa, qw, torch.zeros(4096, device=DEVICE)) < FP32_BOUND
