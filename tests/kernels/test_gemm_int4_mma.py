"""The int4 mma.sync decode kernel (`gemm_int4_mma.py`) against the fp64 product of the dequantized weight, held to
the in-register kernel's bound (`within_bound`): exact q - z operands, fp32 sums, one rounding per group's scale
and one at the store.

Under the interpreter (the CPU) the kernel's Triton code runs with its inline PTX replaced by an fp64 emulation of
one step of `mma.sync.m16n8k16` per warp, built from the instruction's documented fragment layout: lane (g, t)
holds A rows g and g + 8 at K slots 2t, 2t + 1, 2t + 8, 2t + 9, and B column g at the same slots. That checks
which words, lanes, zero points, scales and activation pairs meet; the PTX's own arithmetic (lop3, the packed
FMA, the MMA) runs on the GPU."""

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter
from triton import language as tl

from fxquant.kernels import gemm_int4_mma
from fxquant.kernels.gemm_int4_mma import int4_mma_mm, lane_layout_shape, pack_lanes, supports
from fxquant.kernels.gemm_weight_only import weight_operands
from fxquant.numerics import reference as R
from tests.kernels.test_gemm_weight_only import within_bound

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def operands(N, K, M, dtype, symmetric=False, group=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * 0.05
    q = R.quantize(w.to(DEVICE), "int4", ("group", group), symmetric=symmetric)
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE)
    codes, scale = weight_operands(x, q.data, q.scale, "int4", group, N)
    return q, x, bias, codes, *pack_lanes(scale, q.zero_point)


def test_pack_lanes_puts_each_scale_and_zero_point_where_the_kernel_reads_it():
    N, G = 200, 3  # a row tail: 4 tiles of 64, the last one padded
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(N, G, generator=gen) + 0.5
    zero = torch.randint(0, 16, (N, G), generator=gen, dtype=torch.uint8)
    lane_scale, lane_zero = pack_lanes(scale, zero)
    assert lane_scale.shape == lane_layout_shape(N, 128 * G, 128) == (4, G, 8, 4, 2)
    flat_scale, flat_zero = lane_scale.reshape(-1), lane_zero.reshape(-1).view(torch.uint8)
    for n in range(256):
        tile, block, half, g = n // 64, n % 64 // 16, n % 16 // 8, n % 8
        for j in range(G):
            lane_pack = (tile * G + j) * 8 + g  # the kernel's record index, then (block, half) within it
            at = lane_pack * 8 + block * 2 + half
            assert flat_scale[at] == (scale[n, j] if n < N else 0)
            assert flat_zero[at] == (zero[n, j] if n < N else 0)


def _bits_as_float(halves: np.ndarray, dtype) -> np.ndarray:
    """16-bit patterns as float64 values of bf16 or fp16."""
    if dtype == torch.bfloat16:
        return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return halves.astype(np.uint16).view(np.float16).astype(np.float64)


def _emulated_step(dtype):
    """create_inline_asm for the interpreter: one K step of one 16-row block (`_step_asm`'s operands) in fp64."""
    lane = np.arange(32)
    g, t = lane // 4, lane % 4

    def create_inline_asm(self, asm, constraints, values, types, is_pure, pack):
        words = [np.broadcast_to(v.data, (32,)).astype(np.int64) & 0xFFFFFFFF for v in values]
        rows_g, rows_g8, z_g, z_g8, pairs = words[0:4], words[4:8], words[8] & 0xFF, words[9] & 0xFF, words[10:]
        nibble = lambda word, n: (word >> (4 * n)) & 15
        c_tile = np.zeros((16, 8))
        for c in range(8):
            u, e = divmod(c, 2)
            a, b = np.zeros((16, 16)), np.zeros((16, 8))
            for rows, zero, r in ((rows_g[u], z_g, g), (rows_g8[u], z_g8, g + 8)):
                a[r, 2 * t], a[r, 2 * t + 1] = nibble(rows, 2 * e) - zero, nibble(rows, 2 * e + 4) - zero
                a[r, 2 * t + 8], a[r, 2 * t + 9] = nibble(rows, 2 * e + 1) - zero, nibble(rows, 2 * e + 5) - zero
            for word, k in ((pairs[2 * c], 2 * t), (pairs[2 * c + 1], 2 * t + 8)):
                b[k, g], b[k + 1, g] = _bits_as_float(word & 0xFFFF, dtype), _bits_as_float(word >> 16, dtype)
            c_tile += a @ b
        out = [c_tile[g, 2 * t], c_tile[g, 2 * t + 1], c_tile[g + 8, 2 * t], c_tile[g + 8, 2 * t + 1]]

        class Result:
            def get_result(self, i):
                return interpreter.TensorHandle(out[i].astype(np.float32), tl.float32)

        return Result()

    return create_inline_asm


@pytest.mark.skipif(GPU, reason="the interpreter's emulation of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K,group,symmetric,split", [(1, 128, 256, 128, False, 2), (3, 200, 384, 128, True, 1),
                                                         (8, 64, 512, 256, False, 3)])
def test_the_kernels_data_flow_under_the_interpreter(monkeypatch, dtype, M, N, K, group, symmetric, split):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _emulated_step(dtype), raising=False)
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, dtype, symmetric, group)
    out = int4_mma_mm(x, codes, lane_scale, lane_zero, group, bias, split=split)
    assert out.shape == (M, N) and out.dtype == dtype
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K,group,symmetric", [(1, 4096, 4096, 128, False), (1, 4160, 1024, 128, True),
                                                   (3, 200, 384, 128, False), (8, 6144, 512, 256, False)])
def test_the_kernel_on_the_gpu(dtype, M, N, K, group, symmetric):
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, dtype, symmetric, group)
    assert supports(x, group) is None
    for split in (None, 1, 5):
        out = int4_mma_mm(x, codes, lane_scale, lane_zero, group, bias, split=split)
        assert out.shape == (M, N) and out.dtype == dtype
        assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


def test_tensors_off_the_gpu_take_the_in_register_kernel():
    assert "no sm_80+ GPU" in supports(torch.randn(1, 256, dtype=torch.bfloat16), 128)


@pytest.mark.gpu
def test_what_the_kernel_refuses_on_the_gpu():
    """Each refusal differs from an accepted product in one thing."""
    x = torch.randn(1, 256, dtype=torch.bfloat16, device="cuda")
    assert supports(x, 128) is None and supports(x, 256) is None
    assert "group 64" in supports(x, 64)  # groups narrower than a 128-long K step
    assert "K = 200" in supports(torch.randn(1, 200, dtype=torch.bfloat16, device="cuda"), 128)  # K not whole steps
    assert "M = 9" in supports(torch.randn(9, 256, dtype=torch.bfloat16, device="cuda"), 128)  # past one MMA's B
    assert "torch.float32" in supports(x.float(), 128)
    assert "int32 pairs" in supports(torch.randn(1, 257, dtype=torch.bfloat16, device="cuda")[:, 1:], 128)


def test_split_k_aims_at_900_programs_with_3_steps_per_slice_and_16_slices_at_most():
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (14336, 4096), (4096, 14336), (64, 256), (64, 65536)]
    assert [gemm_int4_mma.int4_mma_split(N, K) for N, K in shapes] == [10, 10, 3, 5, 15, 1, 16]
