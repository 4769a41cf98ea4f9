"""In-kernel decoding of packed 4-bit weights and of words of e4m3 codes, bit for bit against the reference's
unpacking and decoding: every code, every int4 zero point and FP4 scales across their range, in K order. On the GPU
the bf16 (and for int4 and e4m3 words fp16) paths run PTX; the interpreter runs the fp32 path."""

import pytest
import torch
import triton
import triton.language as tl
from fp8_cases import same_bits

from fxquant.kernels import codes
from fxquant.kernels.codes import e4m3_words, fp4_values, int4_differences, pair_order, scale_bf16_pair
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
                      WORDS: tl.constexpr, FMT: tl.constexpr):
    rows = tl.arange(0, ROWS)
    packed = tl.load(w_ptr + rows[:, None] * WORDS + tl.arange(0, WORDS)[None, :])
    BLOCKS: tl.constexpr = WORDS * 8 // GROUP
    raw = tl.load(s_ptr + rows[:, None] * BLOCKS + tl.arange(0, BLOCKS)[None, :]).to(tl.int32)
    values = fp4_values(packed, raw, GROUP, DOT, FMT)
    tl.store(out_ptr + rows[:, None] * 8 * WORDS + tl.arange(0, 8 * WORDS)[None, :], values)


@pytest.mark.filterwarnings("ignore:overflow encountered in multiply")  # 6 x 2^127 is inf, as in the reference
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fmt,group", [("mxfp4", 32), ("nvfp4", 16)], ids=["mxfp4", "nvfp4"])
def test_fp4_values_match_the_decoded_codes(fmt, group, dtype):
    """From the scale codes as stored. NVFP4 in bf16 (its GEMM's path) comes out times 2^-8, which the GEMM's
    epilogue restores; the other paths take no prescale."""
    rows, words = 32, 16
    gen = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (rows, 4 * words), dtype=torch.uint8, generator=gen)
    blocks = words * 8 // group
    if fmt == "mxfp4":  # E8M0: every code, the subnormal 2^-127, 1, 2^127 (6 x 2^127 overflows to inf) and NaN among
        codes_ = torch.arange(rows * blocks, dtype=torch.int32).reshape(rows, blocks) % 256
        scale = decode(codes_, E8M0)
    else:  # e4m3 scales, subnormals included
        codes_ = torch.randint(0, 127, (rows, blocks), generator=gen, dtype=torch.int32)
        scale = decode(codes_, E4M3)
    expected = (decode(unpack_nibbles(packed), E2M1).view(rows, blocks, group) * scale[:, :, None]).view(rows, -1)
    out = torch.empty(rows, 8 * words, dtype=dtype, device=DEVICE)
    _fp4_values_kernel[(1,)](packed.to(DEVICE).view(torch.int32), codes_.to(torch.uint8).to(DEVICE), out,
                             GROUP=group, DOT=TL[dtype], ROWS=rows, WORDS=words, FMT=codes.FORMATS[fmt])
    if fmt == "nvfp4" and dtype == torch.bfloat16:
        expected = expected / codes.NVFP4_UNSCALE.value
    assert same_bits(out.cpu(), expected.to(dtype)) == 0


@triton.jit
def _scale_pair_kernel(s_ptr, out_ptr, FMT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, scale_bf16_pair(tl.load(s_ptr + offs).to(tl.int32), FMT))


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_scale_pairs_are_the_multipliers_bf16_bits_twice(fmt):
    """Every scale code: E8M0's value (the subnormal 2^-127 and NaN included), e4m3's times 2^118 (subnormals,
    negatives, NaN), as bf16 bits in both halves. Integer ops only: this runs where the PTX that takes it cannot."""
    raw = torch.arange(256, dtype=torch.int32)
    out = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _scale_pair_kernel[(1,)](raw.to(torch.uint8).to(DEVICE), out, FMT=codes.FORMATS[fmt])
    want = decode(raw, E8M0) if fmt == "mxfp4" else decode(raw, E4M3) * codes.NVFP4_PRESCALE.value
    halves = out.cpu().view(torch.int16).view(torch.bfloat16).reshape(256, 2)  # little-endian: low half first
    # Triton's interpreter converts e4m3's NaN codes to +-480; the GPU's conversion gives NaN (checked there)
    kept = (raw & 127) != 127 if fmt == "nvfp4" and DEVICE == "cpu" else raw >= 0
    assert same_bits(halves[kept, 0], want[kept].bfloat16()) == 0
    assert same_bits(halves[kept, 1], want[kept].bfloat16()) == 0


@triton.jit
def _pair_order_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, K: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * K + tl.arange(0, K)[None, :]
    tl.store(out_ptr + offs, pair_order(tl.load(x_ptr + offs)))


def test_pair_order_puts_each_pair_side_by_side():
    """Position 8w + 2j + h holds K position 8w + j + 4h: the pairs (j, j + 4) that the PTX decodes together."""
    x = torch.arange(4 * 32, dtype=torch.int32).reshape(4, 32)
    out = torch.empty_like(x, device=DEVICE)
    _pair_order_kernel[(1,)](x.to(DEVICE), out, ROWS=4, K=32)
    want = torch.tensor([8 * w + j + 4 * h for w in range(4) for j in range(4) for h in range(2)], dtype=torch.int32)
    assert torch.equal(out.cpu(), (x[:, :1] + want[None, :]))


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
