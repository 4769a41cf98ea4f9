"""Programmatic dependent launch and the weight prefetch: on where the GPU has them, off under the interpreter, and
the same bits either way."""

import pytest
import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant import reference as R
from fxquant.kernels import pdl
from fxquant.kernels.gemm_fp8 import _fp8_gemm_kernel, fp8_scaled_mm
from fxquant.kernels.gemm_weight_only import weight_only_mm

H200_SMS, H200_L2 = 132, 50 * 2**20


def test_off_under_the_interpreter_and_inside_disabled():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        assert pdl.pdl_options(_fp8_gemm_kernel, device) == {"PDL": False}
    with pdl.disabled():
        assert pdl.pdl_options(_fp8_gemm_kernel, device) == {"PDL": False}
    assert pdl.ENABLED


def test_the_programs_that_run_at_once_share_half_the_l2():
    step = 64 * 128  # a decode tile's K step of fp8: 64 rows x 128 bytes
    # 4096x4096 at decode: 264 programs, each with a 1024-byte slice of 64 rows (8 steps); 12 steps fit.
    assert pdl.prefetch_steps(264, step, H200_SMS, H200_L2) == 12
    assert 264 * 12 * step <= H200_L2 // 2 < 264 * 13 * step
    # Past what can be resident (8 per SM), the budget is shared by the resident programs only.
    assert pdl.prefetch_steps(10**6, step, H200_SMS, H200_L2) == pdl.prefetch_steps(8 * H200_SMS, step, H200_SMS,
                                                                                    H200_L2) == 3
    # A grid whose first steps alone pass the budget still prefetches the first step, which it reads at once.
    assert pdl.prefetch_steps(1056, 2**20, H200_SMS, H200_L2) == 1


def test_prefetch_needs_rows_contiguous_along_k_and_16_byte_aligned():
    w = torch.zeros(64, 256, dtype=torch.uint8)
    assert pdl.prefetchable(w)
    assert not pdl.prefetchable(w.t())  # K strided
    assert not pdl.prefetchable(w[:, 3:])  # unaligned start
    assert not pdl.prefetchable(torch.zeros(64, 200, dtype=torch.uint8)[:, :8])  # row stride 200 bytes
    assert pdl.prefetchable(torch.zeros(64, 64, dtype=torch.int32))  # packed 4-bit words: 256-byte rows


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["fp8_block", "fp8_row"])
def test_a_decode_chain_gives_the_same_bits_with_and_without_pdl(scheme):
    """norm -> fp8, split-K GEMM, reduce, quantize, GEMM, reduce: each kernel waits for the one before it, and
    each GEMM prefetches its weight while the previous kernel runs."""
    gran, group = {"fp8_block": (("block", 128, 128), 128), "fp8_row": ("channel", 0)}[scheme]
    torch.manual_seed(0)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    w1 = R.quantize(torch.randn(6144, 4096, device="cuda") * 0.02, "fp8_e4m3", gran)
    w2 = R.quantize(torch.randn(4096, 6144, device="cuda") * 0.02, "fp8_e4m3", gran)
    ops = torch.ops.fxquant

    def chain():
        a, s = ops.add_norm_quant_fp8(x, x, norm_w, None, 1e-6, group, True)[:2]
        h = ops.scaled_mm_fp8(a, s, w1.data, w1.scale, None, torch.bfloat16)
        return ops.linear_fp8(h, w2.data, w2.scale, None, group)

    assert pdl.pdl_options(_fp8_gemm_kernel, x.device)["PDL"] == (torch.cuda.get_device_capability() >= (9, 0))
    with_pdl = [chain() for _ in range(20)]
    with pdl.disabled():
        without = chain()
    assert all(torch.equal(out, without) for out in with_pdl)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_weight_only_decode_gives_the_same_bits_with_and_without_pdl(fmt):
    gran, group = {"int8": ("channel", 0), "int4": (("group", 128), 128)}[fmt]
    torch.manual_seed(0)
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    q = R.quantize(torch.randn(14336, 4096, device="cuda") * 0.02, fmt, gran)
    run = lambda: weight_only_mm(x, q.data, q.scale, fmt, group, 14336, zero_point=q.zero_point)
    with_pdl = [run() for _ in range(10)]
    with pdl.disabled():
        without = run()
    assert all(torch.equal(out, without) for out in with_pdl)


@pytest.mark.gpu
def test_empty_k_slices_prefetch_nothing():
    """SPLIT_K = 8 over 5 K steps: three slices own no K step, and their partials are zeros."""
    torch.manual_seed(0)
    qa = R.quantize(torch.randn(4, 640, device="cuda"), "fp8_e4m3", "token")
    qw = R.quantize(torch.randn(256, 640, device="cuda"), "fp8_e4m3", "channel")
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.float32, {"SPLIT_K": 8})
    assert float((out.double() - exact).norm() / exact.norm()) < 1e-3
