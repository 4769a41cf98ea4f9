"""Packed 4-bit codes in tiles (`code_tiles.py`): the conversion each way, and every kernel that reads packed int4,
MXFP4 or NVFP4 codes giving the same bits from tiles as from the rows they tile. Under the interpreter on the CPU (the
mma.sync kernels' PTX through ptx_emulator), and on the GPU."""

import pytest
import test_gemm_fp4_mma as fp4
import torch
import triton.runtime.interpreter as interpreter
from test_gemm_int4_mma import _ptx_step, operands

from fxquant.kernels import dependent_launch
from fxquant.kernels.code_tiles import tile_codes, tiled_shape, tiles_fit, untile_codes
from fxquant.kernels.dequantize_weight import dequantize_weight
from fxquant.kernels.gemm_fp4_mma import fp4_mma_mm
from fxquant.kernels.gemm_int4_mma import int4_mma_mm
from fxquant.kernels.gemm_weight_only import DEQUANTIZE_ABOVE_M, weight_only_mm, weight_operands

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


def test_a_tile_is_64_rows_of_128_codes_in_their_stored_order_and_untiling_gives_the_rows_back():
    codes = torch.randint(0, 256, (128, 192), dtype=torch.uint8)  # N 128, K 384: 2 x 3 tiles
    tiles = tile_codes(codes)
    assert tiles.shape == tiled_shape(128, 384) == (2, 3, 64, 64)
    assert torch.equal(tiles[1, 2], codes[64:128, 128:192])  # tile (1, 2): rows 64.., bytes 128.. (codes 256..)
    assert torch.equal(untile_codes(tiles), codes)


def test_weights_whose_rows_do_not_fill_a_tile_are_refused_by_name():
    assert tiles_fit(4096, 14336) and not tiles_fit(4160 + 32, 4096) and not tiles_fit(64, 192)
    with pytest.raises(ValueError, match=r"\[96, 256\] weight do not tile: tiles need N a multiple of 64"):
        tile_codes(torch.zeros(96, 128, dtype=torch.uint8))


def _int4(N, K, M, dtype=torch.bfloat16, symmetric=False):
    q, x, bias, codes, lane_scale, lane_zero = operands(N, K, M, dtype, symmetric)
    return q, x, bias, lane_scale, lane_zero


@pytest.mark.parametrize("M", [1, 5, DEQUANTIZE_ABOVE_M + 3])  # in registers, and dequantized for the GEMM
@pytest.mark.parametrize("symmetric", [False, True], ids=["zero points", "symmetric"])
def test_the_weight_only_gemm_gives_the_same_bits_from_tiles(M, symmetric):
    """From rows and tiles, and on a GPU with dependent launch, from either with its first codes prefetched."""
    q, x, bias, _, _ = _int4(128, 384, M, symmetric=symmetric)
    rows = weight_only_mm(x, q.data, q.scale, "int4", 128, 128, zero_point=q.zero_point, bias=bias)
    for codes in (q.data, tile_codes(q.data)):
        assert torch.equal(weight_only_mm(x, codes, q.scale, "int4", 128, 128, zero_point=q.zero_point, bias=bias),
                           rows)
        with dependent_launch.weights_prefetched(True):
            assert torch.equal(weight_only_mm(x, codes, q.scale, "int4", 128, 128, zero_point=q.zero_point,
                                              bias=bias), rows)


def test_the_dequantizer_gives_the_same_weight_from_tiles():
    q, x, *_ = _int4(192, 256, 1)
    codes, scale = weight_operands(x, q.data, q.scale, "int4", 128, 192)
    tiles, _ = weight_operands(x, tile_codes(q.data), q.scale, "int4", 128, 192)
    expect = dequantize_weight(codes, scale, "int4", 128, 256, torch.bfloat16, zero_point=q.zero_point)
    assert torch.equal(dequantize_weight(tiles, scale, "int4", 128, 256, torch.bfloat16, zero_point=q.zero_point),
                       expect)


def test_tiles_of_the_wrong_shape_are_refused_naming_the_shape_expected():
    q, x, *_ = _int4(128, 256, 1)
    with pytest.raises(ValueError, match=r"tiles must be \(2, 2, 64, 64\) for an \[N=128, K=256\] weight"):
        weight_operands(x, tile_codes(q.data).reshape(1, 4, 64, 64), q.scale, "int4", 128, 128)


@pytest.mark.skipif(GPU, reason="the interpreter with an emulator of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("symmetric", [False, True], ids=["zero points", "symmetric"])
def test_the_mma_kernel_gives_the_same_bits_from_tiles_under_the_interpreter(monkeypatch, symmetric):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", _ptx_step, raising=False)
    q, x, bias, lane_scale, lane_zero = _int4(128, 384, 3, symmetric=symmetric)
    codes, _ = weight_operands(x, q.data, q.scale, "int4", 128, 128)
    tiles, _ = weight_operands(x, tile_codes(q.data), q.scale, "int4", 128, 128)
    rows = int4_mma_mm(x, codes, lane_scale, lane_zero, 128, bias, split=2)
    assert torch.equal(int4_mma_mm(x, tiles, lane_scale, lane_zero, 128, bias, split=2), rows)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (6144, 1024)])
def test_the_mma_kernel_gives_the_same_bits_from_tiles_on_the_gpu(N, K):
    """From rows, from tiles, and from tiles whose first steps it asked of the L2 before its wait (the kernel's
    dependent launch on, where the GPU has it: the prefetch is compiled in only then)."""
    q, x, bias, lane_scale, lane_zero = _int4(N, K, 1)
    codes, _ = weight_operands(x, q.data, q.scale, "int4", 128, N)
    tiles, _ = weight_operands(x, tile_codes(q.data), q.scale, "int4", 128, N)
    for split in (None, 1, 5, 16):  # 16: two K steps a slice at K = 4096, eight slices with none at K = 1024
        rows = int4_mma_mm(x, codes, lane_scale, lane_zero, 128, bias, split=split)
        assert torch.equal(int4_mma_mm(x, tiles, lane_scale, lane_zero, 128, bias, split=split), rows)
        with dependent_launch.weights_prefetched(True):
            assert torch.equal(int4_mma_mm(x, tiles, lane_scale, lane_zero, 128, bias, split=split), rows)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("M", [1, 5, DEQUANTIZE_ABOVE_M + 3])  # in registers, and dequantized for the GEMM
def test_fp4_codes_give_the_weight_only_gemm_and_the_dequantizer_the_same_bits_from_tiles(fmt, M):
    q, x, bias, codes, _ = fp4.operands(fmt, 128, 384, M)
    rows = weight_only_mm(x, q.data, q.scale, fmt, fp4.BLOCK[fmt], 128, global_scale=q.global_scale, bias=bias)
    tiles = tile_codes(q.data)
    assert torch.equal(weight_only_mm(x, tiles, q.scale, fmt, fp4.BLOCK[fmt], 128, global_scale=q.global_scale,
                                      bias=bias), rows)
    words, scale = weight_operands(x, tiles, q.scale, fmt, fp4.BLOCK[fmt], 128)
    assert torch.equal(dequantize_weight(words, scale, fmt, fp4.BLOCK[fmt], 384, torch.bfloat16,
                                         global_scale=q.global_scale),
                       dequantize_weight(codes, scale, fmt, fp4.BLOCK[fmt], 384, torch.bfloat16,
                                         global_scale=q.global_scale))


@pytest.mark.skipif(GPU, reason="the interpreter with an emulator of the PTX; the GPU runs the PTX itself below")
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_the_fp4_mma_kernel_gives_the_same_bits_from_tiles_under_the_interpreter(monkeypatch, fmt):
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", fp4._ptx_step, raising=False)
    q, x, bias, codes, lanes = fp4.operands(fmt, 128, 384, 3)
    _, _, _, tiles, _ = fp4.operands(fmt, 128, 384, 3, tiled=True)
    rows = fp4_mma_mm(x, codes, lanes, fmt, q.global_scale, bias, split=2)
    assert torch.equal(fp4_mma_mm(x, tiles, lanes, fmt, q.global_scale, bias, split=2), rows)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_the_fp4_mma_kernel_gives_the_same_bits_from_tiles_on_the_gpu(fmt):
    q, x, bias, codes, lanes = fp4.operands(fmt, 4096, 4096, 1)
    _, _, _, tiles, _ = fp4.operands(fmt, 4096, 4096, 1, tiled=True)
    for split in (None, 1, 5, 16):
        rows = fp4_mma_mm(x, codes, lanes, fmt, q.global_scale, bias, split=split)
        assert torch.equal(fp4_mma_mm(x, tiles, lanes, fmt, q.global_scale, bias, split=split), rows)
