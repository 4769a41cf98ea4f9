"""In-kernel decoding of packed 4-bit weights and of words of e4m3 codes, bit for bit against the reference's
unpacking and decoding: every code, every int4 zero point and FP4 scales across their range, in K order. On the GPU
the bf16 (and for int4 and e4m3 words fp16) paths run PTX; the interpreter runs the fp32 path."""

import pytest
import torch
import triton
import triton.language as tl
from fp8_cases import same_bits

from fxquant.kernels import codes
from fxquant.kernels.codes import e4m3_words, fp4_values, int4_differences
from fxquant.numerics.formats import E2M1, E4M3, E8M0
from fxquant.numerics.minifloat import decode, unpack_nibbles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32] if DEVICE == "cuda" else [torch.float32]
TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _int4_differences_kernel(w_ptr, z_ptr, out_ptr, DOT: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    packed = tl.load(w_ptr + rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    zero = tl.load(z_ptr + rows).to(tl.int32)
    ints = int4_differences(packed, zero[:, None], DOT)
    tl.store(out_ptr + rows[:, None] * 8 * WORDS + tl.arange(0, 8 * WORDS)[None, :], ints)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4_differences_match_the_unpacked_codes(dtype):
    rows, words = 32, 16
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (rows, 4 * words), dtype=torch.uint8, generator=gen)
    zero = torch.arange(rows, dtype=torch.uint8) % 16  # every zero point, twice
    expected = unpack_nibbles(packed).to(torch.int32) - zero[:, None].to(torch.int32)
    out = torch.empty(rows, 8 * words, dtype=dtype, device=DEVICE)
    _int4_differences_kernel[(1,)](packed.to(DEVICE).view(torch.int32), zero.to(DEVICE), out, DOT=TL[dtype],
                                   ROWS=rows, WORDS=words)
    assert same_bits(out.cpu(), expected.to(dtype)) == 0


@triton.jit
def _fp4_values_kernel(w_ptr, s_ptr, out_ptr, GROUP: tl.constexpr, DOT: tl.constexpr, ROWS: tl.constexpr,
                      WORDS: tl.constexpr, PRESCALED: tl.constexpr):
    rows = tl.arange(0, ROWS)
    packed = tl.load(w_ptr + rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    BLOCKS: tl.constexpr = WORDS * 8 // GROUP
    scale = tl.load(s_ptr + rows[:, None] * BLOCKS + tl.arange(0, BLOCKS)[None, :])
    values = fp4_values(packed, scale, GROUP, DOT, PRESCALED)
    tl.store(out_ptr + rows[:, None] * 8 * WORDS + tl.arange(0, 8 * WORDS)[None, :], values)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")  # 6 x 2^127 is inf, as in the reference
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,group,prescaled", [("mxfp4", 32, False), ("nvfp4", 16, False), ("nvfp4", 16, True)],
                         ids=["mxfp4", "nvfp4", "nvfp4_prescaled"])
def test_fp4_values_match_the_decoded_codes(fmt, group, prescaled, dtype):
    """prescaled (NVFP4's GEMM): in bf16 every value comes out times 2^-8, which the GEMM's epilogue restores; the
    other paths take no prescale."""
    rows, words = 32, 16
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (rows, 4 * words), dtype=torch.uint8, generator=gen)
    blocks = words * 8 // group
    if fmt == "mxfp4":  # E8M0: the subnormal 2^-127, 1, 2^127 (6 x 2^127 overflows to inf), NaN, and random
        exponents = torch.randint(0, 256, (rows, blocks), dtype=torch.int32, generator=gen)
        exponents[0, :4] = torch.tensor([0, 127, 254, 255])
        scale = decode(exponents, E8M0)
    else:  # e4m3 scales, subnormals included
        scale = decode(torch.randint(0, 127, (rows, blocks), generator=gen), E4M3)
    expected = (decode(unpack_nibbles(packed), E2M1).view(rows, blocks, group) * scale[:, :, None]).view(rows, -1)
    out = torch.empty(rows, 8 * words, dtype=dtype, device=DEVICE)
    _fp4_values_kernel[(1,)](packed.to(DEVICE).view(torch.int32), scale.to(DEVICE), out, GROUP=group,
                             DOT=TL[dtype], ROWS=rows, WORDS=words, PRESCALED=prescaled)
    if prescaled and dtype == torch.bfloat16:
        expected = expected / codes.NVFP4_UNSCALE.value
    assert same_bits(out.cpu(), expected.to(dtype)) == 0



@triton.jit
def _e4m3_words_kernel(w_ptr, out_ptr, DOT: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    rows = tl.arange(0, ROWS)
    words = tl.load(w_ptr + rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    tl.store(out_ptr + rows[:, None] * 4 * WORDS + tl.arange(0, 4 * WORDS)[None, :], e4m3_words(words, DOT))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.bfloat16], ids=str)
def test_e4m3_words_are_their_codes_in_order(dtype):
    """Every e4m3 code (NaNs, zeros of both signs and subnormals included) in each of a word's four bytes."""
    rows, words = 16, 16
    every = torch.arange(256, dtype=torch.uint8)
    codes_in_rows = torch.cat([every.roll(j) for j in range(4)]).reshape(rows, 4 * words)  # round j: byte (c + j) % 4
    out = torch.empty(rows, 4 * words, dtype=dtype, device=DEVICE)
    _e4m3_words_kernel[(1,)](codes_in_rows.contiguous().to(DEVICE).view(torch.int32), out, DOT=TL[dtype], ROWS=rows,
                             WORDS=words)
    assert same_bits(out.cpu(), codes_in_rows.view(torch.float8_e4m3fn).to(dtype)) == 0
