"""The int4 mma.sync decode kernel (`gemm_int4_mma.py`) against the fp64 product of the dequantized weight, held to
the in-register kernel's bound (`within_bound`): exact q - z operands, fp32 sums, one rounding per group's scale
and one at the store.

Under the interpreter (the CPU) the kernel's Triton code runs and its inline PTX runs through `ptx_emulator`: the
shifts, lop3 and packed FMA bit for bit, and `mma.sync.m16n8k16` per warp by the instruction's documented fragment
layout (lane (g, t) holds A rows g and g + 8 at K slots 2t, 2t + 1, 2t + 8, 2t + 9, and B column g at the same
slots), its sum in fp64 rounded once to fp32. That checks the PTX text and which words, lanes, zero points, scales
and activation pairs meet; the GPU runs the PTX itself below."""

import numpy as np
import pytest
import torch
import triton.runtime.interpreter as interpreter
from ptx_emulator import run
from triton import language as tl

from fxquant.kernels import gemm_int4_mma
from fxquant.kernels.code_tiles import tile_codes
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


def _ptx_step(self, asm, constraints, values, types, is_pure, pack):
    """create_inline_asm for the interpreter: the kernel's PTX run by ptx_emulator over the warp's 32 lanes, its
    outputs fp32 ("=f": the step's four blocks' C fragments) or int32 words ("=r": e4m3 activations as fp16 pairs)."""
    kinds = [c for c in constraints.split(",") if c.startswith("=")]
    out = run(asm, [np.broadcast_to(v.data, (32,)).astype(np.int64) for v in values], outputs=len(kinds))

    class Result:
        def get_result(self, i):
            if kinds[i] == "=f":
                return interpreter.TensorHandle(out[i].view(np.float32), tl.float32)
            return interpreter.TensorHandle(out[i].view(np.int32), tl.int32)

    return Result()


@pytest.mark.skipif(GPU, reason="the interpreter with an emulator of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M,N,K,group,symmetric,split", [(1, 128, 256, 128, False, 2), (3, 200, 384, 128, True, 1),
                                                         (8, 64, 512, 256, False, 3)])
def test_the_kernel_under_the_interpreter(monkeypatch, dtype, M, N, K, group, symmetric, split):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _ptx_step, raising=False)
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, dtype, symmetric, group)
    out = int4_mma_mm(x, codes, lane_scale, lane_zero, group, bias, split=split)
    assert out.shape == (M, N) and out.dtype == dtype
    assert within_bound(out, x, R.dequantize(q, torch.float64), bias)


def biased_sums_bound(x, q, group):
    """What `step_asm(offset_after=True)` adds to the bound: its 16 MMAs a step (8 over magic + q, 8 summing the
    activations) each round an fp32 sum of terms up to 143 |a| (bf16's magic 128 plus 15), at most an ulp (2^-23,
    truncation included), which the group's scale multiplies."""
    scale = q.scale.double().repeat_interleave(group, dim=1)  # [N, K]: each code's group scale
    return 16 * 143 * 2**-23 * (x.double().abs() @ scale.T)


@pytest.mark.skipif(GPU, reason="the interpreter with an emulator of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("M,N,K,group,symmetric,split", [(1, 128, 256, 128, False, 2), (3, 200, 384, 128, True, 1)])
def test_zero_points_after_the_mmas_under_the_interpreter(monkeypatch, M, N, K, group, symmetric, split):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _ptx_step, raising=False)
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, torch.bfloat16, symmetric, group)
    out = int4_mma_mm(x, codes, lane_scale, lane_zero, group, bias, split=split, offset_after=True)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    w = R.dequantize(q, torch.float64)
    assert within_bound(out, x, w, bias, extra=biased_sums_bound(x, q, group))
    off_by_one_zero = w - q.scale.double().repeat_interleave(group, dim=1)  # one code step: what a wrong z costs
    assert not within_bound(out, x, off_by_one_zero, bias, extra=biased_sums_bound(x, q, group))


def w4a8_operands(N, K, M, symmetric, seed=0):
    """e4m3 activation codes [M, K] per token with their fp32 scales, and the int4 weight's operands as `operands`
    makes them."""
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, torch.bfloat16, symmetric, seed=seed)
    qa = R.quantize(x.float() * 3, "fp8_e4m3", "token")
    return q, qa, bias, codes, lane_scale, lane_zero


@pytest.mark.skipif(GPU, reason="the interpreter with an emulator of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("M,N,K,symmetric,split", [(1, 128, 256, True, 2), (3, 200, 384, False, 1),
                                                   (8, 64, 512, True, 3)])
def test_e4m3_activations_under_the_interpreter(monkeypatch, M, N, K, symmetric, split):
    """W4A8 on the int4 kernel: the codes as fp16 pairs (prmt, cvt), the fp16 MMA's exact products, each step's sums
    times the group's scale, the token's scale once at the end."""
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _ptx_step, raising=False)
    q, qa, bias, codes, lane_scale, lane_zero = w4a8_operands(N, K, M, symmetric)
    scale = qa.scale.reshape(M).float()
    out = int4_mma_mm(qa.data, codes, lane_scale, lane_zero, 128, bias, split=split, a_scale=scale)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    x_hp = R.dequantize(qa, torch.float64)
    assert within_bound(out, x_hp, R.dequantize(q, torch.float64), bias)
    with pytest.raises(ValueError, match="a_scale"):
        int4_mma_mm(qa.data, codes, lane_scale, lane_zero, 128, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,symmetric", [(1, 4096, 4096, True), (1, 4160, 1024, False), (8, 6144, 512, True)])
def test_e4m3_activations_on_the_gpu(M, N, K, symmetric):
    q, qa, bias, codes, lane_scale, lane_zero = w4a8_operands(N, K, M, symmetric)
    assert supports(qa.data, 128) is None
    x_hp, w_hp = R.dequantize(qa, torch.float64), R.dequantize(q, torch.float64)
    for split in (None, 1):
        out = int4_mma_mm(qa.data, codes, lane_scale, lane_zero, 128, bias, split=split,
                          a_scale=qa.scale.reshape(M).float())
        assert out.dtype == torch.bfloat16 and within_bound(out, x_hp, w_hp, bias)
        tiles = tile_codes(codes.view(torch.uint8)).view(torch.int32)  # as the backend holds int4_fp8's codes
        assert torch.equal(int4_mma_mm(qa.data, tiles, lane_scale, lane_zero, 128, bias, split=split,
                                       a_scale=qa.scale.reshape(M).float()), out)


def test_zero_points_after_the_mmas_take_bf16_only():
    with pytest.raises(ValueError, match="bf16 only"):
        gemm_int4_mma.step_asm(torch.float16, offset_after=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,group,symmetric", [(1, 4096, 4096, 128, False), (1, 4160, 1024, 128, True),
                                                   (8, 6144, 512, 256, False)])
def test_zero_points_after_the_mmas_on_the_gpu(M, N, K, group, symmetric):
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, torch.bfloat16, symmetric, group)
    for split in (None, 1):
        out = int4_mma_mm(x, codes, lane_scale, lane_zero, group, bias, split=split, offset_after=True)
        assert within_bound(out, x, R.dequantize(q, torch.float64), bias, extra=biased_sums_bound(x, q, group))


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
    assert "int32 words of 2" in supports(torch.randn(1, 257, dtype=torch.bfloat16, device="cuda")[:, 1:], 128)
    e4m3 = torch.randn(1, 260, device="cuda").to(torch.float8_e4m3fn)[:, 2:258]  # rows 2 codes off a word
    assert "int32 words of 4" in supports(e4m3, 128)


def test_split_k_aims_at_900_programs_with_3_steps_per_slice_and_16_slices_at_most():
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (14336, 4096), (4096, 14336), (64, 256), (64, 65536)]
    assert [gemm_int4_mma.int4_mma_split(N, K) for N, K in shapes] == [10, 10, 3, 5, 15, 1, 16]
