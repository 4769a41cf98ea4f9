"""The MXFP4 / NVFP4 mma.sync decode kernel (`gemm_fp4_mma.py`) against the fp64 product of the dequantized weight,
held to the in-register kernel's bound (`within_bound`): exact scaled e2m1 operands, fp32 sums, one rounding at the
store.

Under the interpreter (the CPU) the kernel's Triton code runs and its inline PTX runs through `ptx_emulator`, which
raises on any packed product its bf16 cannot hold exactly: the decode and both multiplies are checked bit for bit,
and which words, lanes, scales and activation pairs meet in `mma.sync.m16n8k16`. The GPU runs the PTX itself below."""

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter
from ptx_emulator import run
from triton import language as tl

from fxquant.kernels.code_tiles import tile_codes
from fxquant.kernels.gemm_fp4_mma import fp4_lane_layout_shape, fp4_mma_mm, pack_fp4_lanes, supports
from fxquant.kernels.gemm_weight_only import weight_operands
from fxquant.numerics import reference as R
from tests.kernels.test_gemm_weight_only import within_bound

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BLOCK = {"mxfp4": 32, "nvfp4": 16}


def operands(fmt, N, K, M, seed=0, spread=0, tiled=False):
    """(q, x, bias, codes as the kernel takes them, lane scales); spread: rows scaled by powers of two up to
    2^+-spread, so the scales span the format's range."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    if spread:
        w = w * torch.exp2(torch.linspace(-spread, spread, N)).round()[:, None]
    q = R.quantize(w.to(DEVICE), fmt)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16).to(DEVICE)
    codes, _ = weight_operands(x, q.data, q.scale, fmt, BLOCK[fmt], N)
    if tiled:
        codes = tile_codes(q.data).view(torch.int32)
    return q, x, bias, codes, pack_fp4_lanes(q.scale, fmt)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_pack_fp4_lanes_puts_each_scale_where_the_kernel_reads_it(fmt):
    N, K = 200, 384  # a row tail: 4 tiles of 64, the last one padded; 3 K steps
    block = BLOCK[fmt]
    parts = 32 // block
    raw = torch.randint(0, 256, (N, K // block), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    lanes = pack_fp4_lanes(raw, fmt)
    assert lanes.dtype == torch.int32 and lanes.shape == fp4_lane_layout_shape(N, K, fmt) == (4, 3, 8, 4, 2 * parts)
    flat = lanes.reshape(-1).view(torch.uint8)
    for n in range(256):
        tile, blk, half, g = n // 64, n % 64 // 16, n % 16 // 8, n % 8
        for step in range(3):
            for t in range(4):
                record = ((tile * 3 + step) * 8 + g) * 4 + t  # the kernel's record index
                for part in range(parts):
                    at = record * 8 * parts + (blk * 2 + half) * parts + part
                    want = raw[n, step * 4 * parts + t * parts + part] if n < N else 0
                    assert flat[at] == want


def _ptx_step(self, asm, constraints, values, types, is_pure, pack):
    """create_inline_asm for the interpreter: the kernel's PTX (`_step_asm`) run by ptx_emulator over the warp's 32
    lanes, fp32 operands (the accumulator in) as their bits, its fp32 accumulator out."""
    def word(v):
        data = np.broadcast_to(v.data, (32,))
        return data.view(np.uint32).astype(np.int64) if data.dtype == np.float32 else data.astype(np.int64)
    out = run(asm, [word(v) for v in values], outputs=4)

    class Result:
        def get_result(self, i):
            return interpreter.TensorHandle(out[i].view(np.float32), tl.float32)

    return Result()


@pytest.mark.skipif(GPU, reason="the interpreter with an emulator of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M,N,K,split,spread,tiled", [(1, 128, 256, 2, 0, False), (3, 200, 384, 1, 0, False),
                                                      (8, 64, 512, 3, 0, True), (2, 128, 256, 1, 100, False)])
def test_the_kernel_under_the_interpreter(monkeypatch, fmt, M, N, K, split, spread, tiled):
    """spread 100: scales from about 2^-105 to 2^95, where an MXFP4 product of a value made exact (times 2^126)
    and its E8M0 scale must stay exact in bf16 (NVFP4's global scale takes the range instead)."""
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _ptx_step, raising=False)
    q, x, bias, codes, lanes = operands(fmt, N, K, M, spread=spread, tiled=tiled)
    out = fp4_mma_mm(x, codes, lanes, fmt, q.global_scale, bias, split=split)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M,N,K,spread,tiled", [(1, 4096, 4096, 0, False), (1, 14336, 4096, 0, True),
                                                (8, 200, 384, 0, False), (2, 128, 256, 100, False)])
def test_the_kernel_on_the_gpu(fmt, M, N, K, spread, tiled):
    q, x, bias, codes, lanes = operands(fmt, N, K, M, spread=spread, tiled=tiled)
    assert supports(x, fmt) is None
    for split in (None, 1, 5):
        out = fp4_mma_mm(x, codes, lanes, fmt, q.global_scale, bias, split=split)
        assert out.shape == (M, N) and out.dtype == torch.bfloat16
        assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


def test_tensors_off_the_gpu_take_the_in_register_kernel():
    assert "no sm_80+ GPU" in supports(torch.randn(1, 256, dtype=torch.bfloat16), "mxfp4")
    assert "'int4'" in supports(torch.randn(1, 256, dtype=torch.bfloat16), "int4")


@pytest.mark.gpu
def test_what_the_kernel_refuses_on_the_gpu():
    """Each refusal differs from an accepted product in one thing."""
    x = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    assert supports(x, "mxfp4") is None and supports(x, "nvfp4") is None
    assert "K = 200" in supports(torch.randn(1, 200, dtype=torch.bfloat16, device="cuda"), "mxfp4")
    assert "M = 9" in supports(torch.randn(9, 256, dtype=torch.bfloat16, device="cuda"), "nvfp4")
    assert "torch.float16" in supports(x.half(), "mxfp4")
    assert "int32 pairs" in supports(torch.randn(1, 257, dtype=torch.bfloat16, device="cuda")[:, 1:], "mxfp4")
