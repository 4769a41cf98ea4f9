"""FP8 scaled GEMM (Triton) against the fp64 product of the dequantized operands."""

import pytest
import torch
import triton

from fxquant.kernels.gemm_configs import BUCKET_PROBES, fp8_gemm_config
from fxquant.kernels.gemm_fp8 import _launch_plan, fp8_scaled_mm
from fxquant.kernels.gemm_fp8_tma import describable
from fxquant.kernels.splitk import split_k
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative error against fp64 for fp32 output: the interpreter accumulates in fp32; sm_90's fp8 MMA
# accumulates 128 K at a time in reduced precision before the fp32 add (see gemm_fp8.py).
FP32_BOUND = 1e-5 if DEVICE == "cpu" else 3e-4
SCHEMES = {"row": ("token", "channel"), "tensor": ("tensor", "tensor"), "block": (("group", 128), ("block", 128, 128))}
# M values land in every bucket; N, K leave tails (N % BLOCK_N, K % BLOCK_K) where the scheme allows.
SHAPES = [(1, 256, 256), (16, 128, 384), (37, 384, 256), (130, 256, 512), (5, 200, 176)]


def operands(M, N, K, scheme, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen) * torch.exp2(torch.randint(-4, 4, (M, 1), generator=gen))
    w = torch.randn(N, K, generator=gen) * 0.05
    ga, gw = SCHEMES[scheme]
    return R.quantize(a.to(DEVICE), "fp8_e4m3", ga), R.quantize(w.to(DEVICE), "fp8_e4m3", gw)


def rel_err(out, qa, qw, bias):
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T + bias.double()
    return float((out.double() - exact).norm() / exact.norm())


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M, N, K", SHAPES, ids=str)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_fp64_product(M, N, K, scheme, out_dtype):
    if scheme == "block" and (N % 128 or K % 128):
        pytest.skip("block scales need N and K multiples of 128 (the granularity refuses others)")
    qa, qw = operands(M, N, K, scheme)
    bias = torch.randn(N, device=DEVICE)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, out_dtype)
    assert out.dtype == out_dtype and out.shape == (M, N)
    # fp32 accumulation: ~1e-6 of the norm; a bf16 output adds its own rounding (2**-9 relative).
    assert rel_err(out, qa, qw, bias) < (FP32_BOUND if out_dtype == torch.float32 else 4e-3)


@pytest.mark.parametrize("scheme", ["block", "row"])
@pytest.mark.parametrize("m", BUCKET_PROBES)
def test_every_bucket_config_is_exercised(m, scheme):
    qa, qw = operands(m, 256, 256, scheme, seed=m)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, torch.zeros(256, device=DEVICE), torch.float32)
    assert rel_err(out, qa, qw, torch.zeros(256, device=DEVICE)) < FP32_BOUND


def test_empty_m_and_bad_shapes():
    qa, qw = operands(4, 128, 128, "row")
    out = fp8_scaled_mm(qa.data[:0], qa.scale[:0], qw.data, qw.scale, None, torch.bfloat16)
    assert out.shape == (0, 128)
    with pytest.raises(ValueError, match="needs a"):
        fp8_scaled_mm(qa.data, qa.scale, qw.data[:, :64], qw.scale, None, torch.bfloat16)
    qa, qw = operands(4, 256, 256, "block")
    wide = dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="BLOCK_N dividing 128"):
        fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.bfloat16, wide)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("config", [{}, {"COMPILER_PROMOTES": False}], ids=["split-k", "split-k-promote-by-hand"])
def test_decode_splits_k_and_stays_exact(scheme, config):
    M, N, K = 4, 256, 2048  # 4 output tiles of 16 x 64 over 16 K steps: split into 4 slices
    cfg = fp8_gemm_config(M, N, K, scheme == "block")
    tiles, steps = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]), K // cfg["BLOCK_K"]
    assert split_k(tiles, steps, cfg["programs"]) == 4
    qa, qw = operands(M, N, K, scheme)
    bias = torch.randn(N, device=DEVICE)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32, config=config)
    assert rel_err(out, qa, qw, bias) < FP32_BOUND
    again = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32, config=config)
    assert torch.equal(out, again)  # slices add in a fixed order: the same bits every run


@pytest.mark.parametrize(("M", "N", "K", "block", "tiles"), [
    (16, 4096, 4096, False, (32, 2)), (9, 6144, 4096, False, (32, 2)), (16, 4096, 14336, False, (32, 2)),
    (8, 4096, 4096, False, (64, 4)), (16, 4096, 4096, True, (64, 4)), (16, 28672, 4096, False, (64, 1))], ids=str)
def test_past_eight_rows_the_row_scaled_weights_that_split_take_32_wide_tiles(M, N, K, block, tiles):
    """docs/decisions/0035: 9-16 rows over q/k/v, o and down (row scales) run 32-wide tiles, two slices each; 8 rows,
    block scales and the gate/up weight keep the sweep's 64-wide tiles."""
    _, split, _, meta = _launch_plan(M, N, K, block, False, ())
    assert (meta["BLOCK_N"], split) == tiles
    if tiles[0] == 32:
        assert meta["num_stages"] == 6


@pytest.mark.parametrize("scheme", ["row", "tensor"])
def test_the_32_wide_decode_tiles_split_k_with_tails_and_stay_exact(scheme):
    M, N, K = 12, 200, 2048  # 7 tiles of 16 x 32, the last 8 columns wide, over 16 K steps: 4 slices
    _, split, _, meta = _launch_plan(M, N, K, False, False, ())
    assert (split, meta["BLOCK_N"]) == (4, 32)
    qa, qw = operands(M, N, K, scheme, seed=3)
    bias = torch.randn(N, device=DEVICE)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32)
    assert rel_err(out, qa, qw, bias) < FP32_BOUND


@pytest.mark.parametrize("M, N, K", [(1, 256, 2048), (16, 200, 384), (5, 128, 176)], ids=str)
def test_decode_with_the_operands_swapped_matches_the_product(M, N, K):
    """SWAP_AB (row scales; the sweep's candidate): the weight's rows as the MMA's M, with N and K tails and split-K.
    Within the kernel's fp32 bound: on sm_90 its wgmma accumulates fp8 products in reduced precision for 128 K."""
    qa, qw = operands(M, N, K, "row")
    bias = torch.randn(N, device=DEVICE)
    swapped = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, programs=264,
                   SWAP_AB=True)
    assert _launch_plan(M, N, K, False, False, tuple(sorted(swapped.items())))[3]["SWAP_AB"]
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32, config=swapped)
    assert rel_err(out, qa, qw, bias) < FP32_BOUND
    assert not _launch_plan(M, N, K, True, False, tuple(sorted(swapped.items())))[3]["SWAP_AB"]  # row scales only
    promoted_by_hand = tuple(sorted({**swapped, "COMPILER_PROMOTES": False}.items()))
    assert not _launch_plan(M, N, K, False, False, promoted_by_hand)[3]["SWAP_AB"]  # the swapped loop's promotion


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("M, N, K", [(1, 256, 2048), (16, 256, 384), (5, 200, 176)], ids=str)
def test_decode_weight_through_a_descriptor_gives_the_pointer_kernels_bits(M, N, K, scheme):
    """WEIGHT_TMA (the chain bench's candidate): the weight's tiles through a tensor descriptor, N and K tails
    zero-filled by the copy engine, split-K as planned. The same tiles and K order as the pointer loads: the same
    bits, and within the fp32 bound of the product."""
    if scheme == "block" and (N % 128 or K % 128):
        pytest.skip("block scales need N and K multiples of 128 (the granularity refuses others)")
    qa, qw = operands(M, N, K, scheme, seed=5)
    bias = torch.randn(N, device=DEVICE)
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, programs=264)
    described = {**tiles, "WEIGHT_TMA": True}
    assert _launch_plan(M, N, K, scheme == "block", False, tuple(sorted(described.items())))[3]["WEIGHT_TMA"]
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32, config=described)
    assert torch.equal(out, fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32, config=tiles))
    assert rel_err(out, qa, qw, bias) < FP32_BOUND


def test_a_weight_no_descriptor_can_read_takes_pointer_loads():
    qa, qw = operands(2, 128, 264, "row")
    w = qw.data[:, 8:]  # rows 264 bytes apart, starting 8 bytes in: not 16-byte aligned
    assert not describable(w)
    described = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, WEIGHT_TMA=True)
    out = fp8_scaled_mm(qa.data[:, 8:], qa.scale, w, qw.scale, None, torch.float32, config=described)
    exact = (qa.data[:, 8:].double() * qa.scale.double()) @ (w.double() * qw.scale.double()).T
    assert float((out.double() - exact).norm() / exact.norm()) < FP32_BOUND


def test_no_default_reads_the_decode_weight_through_a_descriptor():
    for M in BUCKET_PROBES:
        for block in (False, True):
            assert not _launch_plan(M, 4096, 4096, block, False, ())[3]["WEIGHT_TMA"], (M, block)


def test_no_default_swaps_the_operands():
    """SWAP_AB is faster at decode and less exact (docs/decisions/0023): no bucket takes it."""
    for M in BUCKET_PROBES:
        for block in (False, True):
            assert not _launch_plan(M, 4096, 4096, block, False, ())[3]["SWAP_AB"], (M, block)


@pytest.mark.parametrize("scheme", ["block", "row"])
@pytest.mark.parametrize("M, N, K", [(40, 256, 2048), (100, 128, 8448)], ids=["short-k", "long-k"])
def test_medium_m_splits_k_where_tiles_are_few(M, N, K, scheme):
    """The medium bucket's split-K: up to M = 64 on short K, and on long K (> 8192) up to M = 128."""
    tiles, split, _, _ = _launch_plan(M, N, K, scheme == "block", False, ())
    assert split > 1
    qa, qw = operands(M, N, K, scheme)
    bias = torch.randn(N, device=DEVICE)
    out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32)
    assert rel_err(out, qa, qw, bias) < FP32_BOUND
    assert torch.equal(out, fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, bias, torch.float32))
