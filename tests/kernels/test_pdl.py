"""Programmatic dependent launch: on where the GPU has it, off under the interpreter, and the same bits either way."""

import pytest
import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant import reference as R
from fxquant.kernels import pdl
from fxquant.kernels.gemm_fp8 import _fp8_gemm_kernel


def test_off_under_the_interpreter_and_when_disabled(monkeypatch):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        assert pdl.pdl_options(_fp8_gemm_kernel, device) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_options(_fp8_gemm_kernel, device) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_args", [("fp8_block", 128), ("fp8_row", 0)])
def test_a_decode_chain_gives_the_same_bits_with_and_without_pdl(monkeypatch, recipe_args):
    """norm -> fp8, split-K GEMM, reduce, quantize, GEMM, reduce: each kernel waits for the one before it."""
    gran, group = {"fp8_block": (("block", 128, 128), 128), "fp8_row": ("channel", 0)}[recipe_args[0]]
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
    monkeypatch.setattr(pdl, "ENABLED", False)
    without = chain()
    assert all(torch.equal(out, without) for out in with_pdl)
