"""W4A8 with the int4 codes decoded in the TMA kernel's K loop (`gemm_int4_fp8_tma`): the e4m3 identity it rests on,
its nibble split bit for bit (the PTX through the emulator), the activations' group sums, and the dense and grouped
products against the fp64 product of the dequantized operands, within the W4A8 bound of
tests/kernels/test_gemm_int4_fp8.py (one bf16 ulp plus 2^-20 of sum |x w| under the interpreter, 2^-10 on the GPU,
whose fp8 MMA sums each group in a shorter accumulator). The weights lean positive and some activations too, so the
zero point's share taken off after the loop is of the product's size: a correction kept to a bf16's 8 bits would
break the bound."""

import numpy as np
import pytest
import torch
from ptx_emulator import run

import fxquant.kernels.gemm_grouped as G
from fxquant.kernels import gemm_int4_fp8_tma as T
from fxquant.kernels.gemm_int4_fp8 import GROUP, int4_fp8_mm
from fxquant.kernels.gemm_int4_fp8_tma import group_sums
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(TMA=True, BLOCK_M=32, BLOCK_N=64, GROUP_M=2, num_warps=4, num_stages=2)


def test_e4m3_bytes_below_16_are_their_value_times_2_pow_9():
    """The identity the kernel rests on: e4m3 bytes 0..7 are the subnormals u * 2^-9, bytes 8..15 the first normal
    binade (8 + m) * 2^-9, so an unsigned 4-bit code is an e4m3 operand as it is."""
    u = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(u.view(torch.float8_e4m3fn).double(), u.double() * 2.0**-9)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
def test_the_nibble_split_is_each_bytes_codes_bit_for_bit(symmetric):
    """The PTX (through the emulator): output 0 holds each byte's low nibble, output 1 its high nibble, a byte each,
    XORed with 8 for symmetric codes (c ^ 8 = c + 8); every byte value in every position, then random words."""
    asm = (T._NIBBLES_SYMMETRIC if symmetric else T._NIBBLES_UNSIGNED).value
    cycle = np.array([sum(((w + j) % 256) << (8 * j) for j in range(4)) for w in range(256)], dtype=np.int64)
    packed = np.concatenate([cycle, np.random.default_rng(0).integers(0, 2**32, 256, dtype=np.int64)])
    lo, hi = run(asm, [packed], outputs=2)
    flip = 8 if symmetric else 0
    for j in range(4):
        byte = (packed >> (8 * j)) & 255
        assert np.array_equal((lo >> (8 * j)) & 255, (byte & 15) ^ flip)
        assert np.array_equal((hi >> (8 * j)) & 255, (byte >> 4) ^ flip)


def test_group_sums_are_each_rows_codes_summed_per_group():
    gen = torch.Generator().manual_seed(0)
    a = (torch.randn(37, 3 * GROUP, generator=gen) * 50).to(DEVICE, torch.float8_e4m3fn)
    want = a.double().view(37, 3, GROUP).sum(-1)
    got = group_sums(a)
    assert got.shape == (37, 3) and got.dtype == torch.float32
    assert bool(((got.double() - want).abs() <= 2**-20 * a.double().abs().view(37, 3, GROUP).sum(-1)).all())


def w4a8_bound(out, qa, qw, bias):
    a_hp, w_hp = R.dequantize(qa, torch.float64), R.dequantize(qw, torch.float64)
    exact = a_hp @ w_hp.T + (0 if bias is None else bias.double())
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))) * torch.finfo(torch.bfloat16).eps
    tolerance = ulp + (2**-10 if DEVICE == "cuda" else 2**-20) * (a_hp.abs() @ w_hp.abs().T)
    return bool(((out.double() - exact).abs() <= tolerance).all()), float((out.double() - exact).abs().max())


# M tails and one row; N tails; one group, groups past one correction step (40 = 32 + 8)
SHAPES = [(130, 96, 256), (1, 64, 128), (37, 80, 40 * GROUP)]


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_dense_product_decoded_in_the_k_loop(shape, symmetric, bias, monkeypatch):
    """int4_fp8_mm with TMA=True: one expert owning every row, its bias added at the store."""
    launches = []
    monkeypatch.setattr("fxquant.kernels.gemm_int4_fp8.int4_fp8_tma",
                        lambda *a, **k: launches.append(1) or T.int4_fp8_tma(*a, **k))
    M, N, K = shape
    gen = torch.Generator().manual_seed(M + N + K)
    x = (torch.randn(M, K, generator=gen) + torch.rand(M, 1, generator=gen)).to(DEVICE, torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) + 0.3).to(DEVICE, torch.bfloat16)
    b = torch.randn(N, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
    qa = R.quantize(x, "fp8_e4m3", "token")
    qw = R.quantize(w, "int4", ("group", GROUP), symmetric=symmetric)
    out = int4_fp8_mm(qa.data, qa.scale, qw.data, qw.scale, qw.zero_point, b, torch.bfloat16, SMALL)
    assert launches == [1] and out.shape == (M, N)
    within, worst = w4a8_bound(out, qa, qw, b)
    assert within, worst


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
def test_grouped_past_128_rows_an_expert_takes_it(symmetric, monkeypatch):
    """No config: past 128 rows an active expert the grouped W4A8 product decodes the codes in the K loop at the
    kernel's tiles, with no e4m3 copy of the weight; rows no expert owns stay zero."""
    launches = []
    monkeypatch.setattr(G, "int4_fp8_tma", lambda *a, **k: launches.append(a[-1]) or T.int4_fp8_tma(*a, **k))
    monkeypatch.setattr(G, "int4_as_e4m3", lambda *a: pytest.fail("the codes were made e4m3"))
    gen = torch.Generator().manual_seed(3)
    counts, tail = [301, 0, 179, 90], 7
    offs = torch.tensor(counts).cumsum(0).to(DEVICE, torch.int32)
    m, k, n = sum(counts) + tail, 2 * GROUP, 96
    x = (torch.randn(m, k, generator=gen) + 1.0).to(DEVICE, torch.bfloat16)
    experts = [R.quantize((torch.randn(n, k, generator=gen) + 0.3).to(DEVICE), "int4", ("group", GROUP),
                          symmetric=symmetric) for _ in counts]
    qa, qw = R.quantize(x, "fp8_e4m3", "token"), R.stack_experts(experts)
    got = G.grouped_int4_fp8_mm(qa.data, qa.scale, offs, qw.data, qw.scale, qw.zero_point)
    assert launches == [T.TILES]
    assert torch.equal(got[sum(counts):], torch.zeros_like(got[sum(counts):]))
    start = 0
    for e, rows in enumerate(counts):
        if rows:
            rows_q = R.quantize(x[start:start + rows], "fp8_e4m3", "token")  # per token: the same codes and scales
            within, worst = w4a8_bound(got[start:start + rows], rows_q, experts[e], None)
            assert within, (e, worst)
        start += rows

