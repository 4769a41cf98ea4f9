"""The inline PTX that decodes packed 4-bit codes and words of e4m3 codes on the GPU (`kernels/codes.py`), run on the
CPU by `ptx_emulator`, bit for bit against the reference's decoding: every nibble in every position of a word, every
int4 zero point in bf16 and fp16, E8M0 and e4m3 scales across their range, and every e4m3 code in every byte. The
interpreter runs no PTX, so without this the blocks are checked only on a GPU (tests/kernels/test_codes.py)."""

import numpy as np
import pytest
import torch
from fp8_cases import same_bits
from ptx_emulator import run

from fxquant.kernels import codes
from fxquant.numerics.formats import E2M1, E4M3, E8M0
from fxquant.numerics.minifloat import decode


def words(count: int, seed: int) -> np.ndarray:
    """Random packed words, led by words that put every nibble in every position (nibble j of word w is (w + j) %
    16 for the first 16)."""
    cycle = np.array([sum(((w + j) % 16) << (4 * j) for j in range(8)) for w in range(16)], dtype=np.int64)
    random = np.random.default_rng(seed).integers(0, 2**32, count, dtype=np.int64)
    return np.concatenate([cycle, random])


def nibbles(packed: np.ndarray) -> torch.Tensor:
    """[n, 8] codes 0..7 of each word, low nibble first."""
    return torch.from_numpy(np.stack([(packed >> (4 * j)) & 15 for j in range(8)], axis=1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_int4_pairs_are_the_codes_less_their_zero_point(dtype):
    asm = (codes._INT4_PAIRS_BF16 if dtype == torch.bfloat16 else codes._INT4_PAIRS_F16).value
    packed = words(240, seed=0)
    zero = np.arange(packed.size) % 16  # every zero point, as int4_differences takes it: an int32 per row
    neg = zero | (0xC300 if dtype == torch.bfloat16 else 0xE400)  # -(OFFSET + z), as the kernel builds it
    one = 0x3F803F80 if dtype == torch.bfloat16 else 0x3C003C00
    neg_up = (zero << 4) | 0xD400  # fp16's -(64 + z), for the nibbles taken four bits up
    out = run(asm, [packed, neg | (neg << 16), one, neg_up | (neg_up << 16)], outputs=8)
    got = torch.from_numpy(np.stack(out, axis=1).astype(np.uint16).view(np.int16)).view(dtype)
    want = (nibbles(packed) - torch.from_numpy(zero)[:, None]).to(dtype)
    assert same_bits(got, want) == 0


@pytest.mark.parametrize("scales", ["e8m0", "e4m3"])
def test_fp4_pairs_are_the_e2m1_values_times_their_scale(scales):
    packed = words(496, seed=1)
    gen = torch.Generator().manual_seed(2)
    if scales == "e8m0":  # every exponent: the subnormal 2^-127, 1, 2^127 (6 x 2^127 overflows to inf), NaN
        scale = decode(torch.arange(packed.size) % 256, E8M0)
    else:  # e4m3 scales, subnormals and 448 included
        scale = decode(torch.randint(0, 127, (packed.size,), generator=gen), E4M3)
        scale[:127] = decode(torch.arange(127), E4M3)
    # as fp4_values builds the pair: the scale in bf16 (exact: 8-bit exponent, at most 4 significant bits), twice
    half = scale.bfloat16().view(torch.int16).numpy().astype(np.uint16).astype(np.int64)
    out = run(codes._FP4_PAIRS_BF16.value, [packed, half | (half << 16), 0x7E807E80], outputs=8)
    got = torch.from_numpy(np.stack(out, axis=1).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    want = (decode(nibbles(packed), E2M1) * scale[:, None]).bfloat16()
    assert same_bits(got, want) == 0
    if scales == "e8m0":
        assert torch.isinf(got).any() and torch.isnan(got).any()  # the range's ends were reached


def test_nvfp4_pairs_prescaled_are_the_values_times_two_to_the_minus_8():
    """NVFP4's one-multiply block: e4m3 scales times NVFP4_PRESCALE (2^118) in bf16, every e4m3 scale from the
    smallest subnormal to 448: each output is the e2m1 value times its scale times 2^-8, bit for bit."""
    packed = words(111, seed=3)
    scale = decode(torch.arange(packed.size) % 127, E4M3)  # every positive e4m3 code, 0 included
    multiplier = (scale * codes.NVFP4_PRESCALE.value).bfloat16()
    assert torch.equal(multiplier.double(), scale.double() * codes.NVFP4_PRESCALE.value)  # exact: a normal bf16
    half = multiplier.view(torch.int16).numpy().astype(np.uint16).astype(np.int64)
    out = run(codes._FP4_PAIRS_BF16_PRESCALED.value, [packed, half | (half << 16)], outputs=8)
    got = torch.from_numpy(np.stack(out, axis=1).astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    want = (decode(nibbles(packed), E2M1) * scale[:, None] / codes.NVFP4_UNSCALE.value).bfloat16()
    assert same_bits(got, want) == 0 and (want != 0).any()


def test_the_emulator_refuses_what_it_does_not_know():
    with pytest.raises(NotImplementedError, match="cvt"):
        run("cvt.rn.f16x2.f32 $0, $1, $2;", [0, 0], outputs=1)
    with pytest.raises(ArithmeticError, match="not exact"):  # 1 + 2^-8 has no bf16: the blocks claim exactness
        run("mul.rn.bf16x2 $0, $1, $2;", [0x3F813F81, 0x3F813F81], outputs=1)


def test_e4m3_quads_are_their_codes_in_fp16():
    every = np.arange(256, dtype=np.int64)
    packed = sum(np.roll(every, 64 * j) << (8 * j) for j in range(4))  # code c in byte j of word (c + 64 j) % 256
    out = run(codes._E4M3_QUADS_F16.value, [packed], outputs=4)
    got = torch.from_numpy(np.stack(out, axis=1).astype(np.uint16).view(np.int16)).view(torch.float16)
    want = torch.from_numpy(np.stack([(packed >> (8 * j)) & 255 for j in range(4)], axis=1).astype(np.uint8))
    assert same_bits(got, want.view(torch.float8_e4m3fn).half()) == 0
