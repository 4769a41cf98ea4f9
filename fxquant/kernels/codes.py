"""In-kernel decoding of codes, shared by the weight-only and W4A8 GEMMs and the weight dequantizer: packed 4-bit words
split into codes, integers made exact floats from bits, e2m1 values, per-block scales, and words of e4m3 codes. The
GEMM's bf16/fp16 paths decode two codes per instruction in inline PTX; the interpreter, which runs no PTX, takes a
one-code-at-a-time path to the same values (tests/kernels/test_codes.py checks both, bit for bit, on a GPU; on the CPU
tests/kernels/test_codes_ptx.py runs the PTX itself through an emulator of the instructions it uses)."""

from __future__ import annotations

import triton
import triton.language as tl

from fxquant.kernels.code_tiles import tiled_words

# the FMT constexpr of the kernels that decode codes
FORMATS = {"int8": 0, "int4": 1, "mxfp4": 2, "nvfp4": 3, "mxfp8": 4}
PACKED = ("int4", "mxfp4", "nvfp4")  # two 4-bit codes per byte; the others take a byte per code
E8M0_MIN = tl.constexpr(2.0**-127)  # E8M0 code 0: the one scale whose fp32 value is subnormal
TWO_POW_23 = tl.constexpr(8388608.0)  # fp32 2^23 has an ulp of 1: its low mantissa bits hold small integers


@triton.jit
def biased(n):
    """2^23 + n as fp32, exactly, for 0 <= n < 2^23: n ORed into 2^23's mantissa. Subtracting a biased integer
    gives an exact difference without an int -> float conversion, which issues at a quarter of the FMA rate."""
    return (n | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_value(code):
    """A 4-bit e2m1 code (sign in bit 3) as its fp32 value, exactly, in three integer ops and two float ops: its
    bits placed in an fp16's sign, exponent and mantissa are the value times 2^-14 (e2m1's subnormal 0.5 lands on
    an fp16 subnormal), and fp16 -> fp32 and the power-of-two multiply are exact."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def scale_codes(s_ptr, offs_n, k_index, stride_sn, stride_sk, mask):
    """The per-(n, k-block) scale codes as stored (E8M0 or e4m3 bytes), as int32."""
    return tl.load(s_ptr + offs_n * stride_sn + k_index * stride_sk, mask=mask, other=0).to(tl.int32)


@triton.jit
def scale_value(raw, FMT: tl.constexpr):
    """Scale codes as their fp32 values: E8M0 (MXFP4, MXFP8) or e4m3 (NVFP4)."""
    if FMT == 2 or FMT == 4:
        value = (raw << 23).to(tl.float32, bitcast=True)
        return tl.where(raw == 0, E8M0_MIN, tl.where(raw == 255, float("nan"), value))
    return raw.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def block_scale(s_ptr, offs_n, k_index, stride_sn, stride_sk, mask, FMT: tl.constexpr):
    """The per-(n, k-block) scales as fp32, from E8M0 (MXFP4, MXFP8) or e4m3 (NVFP4) codes."""
    return scale_value(scale_codes(s_ptr, offs_n, k_index, stride_sn, stride_sk, mask), FMT)


@triton.jit
def mxfp8_values(codes, scale, GROUP: tl.constexpr):
    """[BLOCK_N, BLOCK_K] e4m3 codes (as bytes) times their block's fp32 scale ([BLOCK_N, BLOCK_K / GROUP]), in
    fp32: exact (a code times a power of two), and exact again in bf16 down to 2^-133."""
    BLOCK_N: tl.constexpr = codes.shape[0]
    BLOCK_K: tl.constexpr = codes.shape[1]
    values = tl.reshape(codes.to(tl.float8e4nv, bitcast=True).to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP))
    return tl.reshape(values * scale[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def packed_words(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 TILED: tl.constexpr = False):
    """The [BLOCK_N, BLOCK_K / 8] int32 words of one K step's packed 4-bit codes (nibble j of a little-endian word
    is code j of its 8), from rows of codes or, TILED, from `code_tiles`' tiles."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word = step * WORDS + tl.arange(0, WORDS)
    mask = mask_n[:, None] if EVEN_K else mask_n[:, None] & (word[None, :] * 8 < K)
    return tl.load(w_ptr + packed_word_offsets(offs_n[:, None], word[None, :], K, stride_wn, TILED), mask=mask,
                   other=0)


@triton.jit
def packed_word_offsets(rows, words, K, stride_wn, TILED: tl.constexpr):
    """Offsets of int32 words `words` of packed 4-bit rows `rows` (broadcasting together), in rows of stride_wn
    words or, TILED, in `code_tiles`' tiles."""
    if TILED:
        return tiled_words(rows, words, K)
    return rows.to(tl.int64) * stride_wn + words


@triton.jit
def in_k_order(c0, c1, c2, c3, c4, c5, c6, c7):
    """Codes 0..7 of [BLOCK_N, WORDS] words as one [BLOCK_N, 8 * WORDS] tensor in K order, each word's codes
    kept in one thread. A join appends its pair index as the last dimension, so nested joins reverse the bits of
    the index: pairing codes 4 apart innermost, then 2 apart, then 1 apart puts code k at position k."""
    joined = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(joined, (c0.shape[0], c0.shape[1] * 8))


@triton.jit
def pair_order(t):
    """A [R, 8 * W] operand in K order, permuted within each 8-long run of K so that K positions j and j + 4 (the
    two codes that one PTX instruction of the decoders below decodes together, 16 bits apart in a word) sit side by
    side: position 2j + h holds K position j + 4h. An MMA sums over K in any order, so a product whose two operands
    are both permuted is the same sum; in pair order, each decoded pair is already the register the MMA reads, where
    in K order the pairs were split and repacked (`gemm_weight_only.wo_gemm_config`)."""
    R: tl.constexpr = t.shape[0]
    K: tl.constexpr = t.shape[1]
    return tl.reshape(tl.permute(tl.reshape(t, (R, K // 8, 2, 4)), (0, 1, 3, 2)), (R, K))


@triton.jit
def dot_operands(a, w, PAIR_ORDER: tl.constexpr):
    """Activations a [M, K] and decoded weights w [N, K] as a product takes them: tl.dot(a, tl.trans(w)) is the same
    sum either way, in `pair_order` where PAIR_ORDER, else in K order."""
    if PAIR_ORDER:
        return pair_order(a), tl.trans(pair_order(w))
    return a, tl.trans(w)


@triton.jit
def split_words(packed):
    """[BLOCK_N, WORDS] words as their [BLOCK_N, 8 * WORDS] codes in K order, as int32."""
    return in_k_order(packed & 15, (packed >> 4) & 15, (packed >> 8) & 15, (packed >> 12) & 15,
                      (packed >> 16) & 15, (packed >> 20) & 15, (packed >> 24) & 15, (packed >> 28) & 15)


@triton.jit
def nibbles(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
            TILED: tl.constexpr = False):
    """The [BLOCK_N, BLOCK_K] 4-bit codes of one K step, in K order, as int32."""
    return split_words(packed_words(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K, EVEN_K, TILED))


@triton.jit
def int4_differences(packed, zero, DOT: tl.constexpr):
    """q - z for every code q of the [BLOCK_N, WORDS] words, with z the [BLOCK_N, 1] int32 zero points: exact
    small integers in DOT, [BLOCK_N, 8 * WORDS] in K order. On the GPU (bf16, fp16) two codes go at a time in
    PTX: a masked pair of nibbles ORed into a pair of biased floats (OFFSET + q, OFFSET's ulp being 1) is one
    lop3, and one packed fma subtracts OFFSET + z from both. The interpreter (DOT fp32), which runs no PTX, builds
    the same values one code at a time."""
    if DOT == tl.float32:
        ints = biased(split_words(packed)) - biased(zero)
    elif DOT == tl.bfloat16:
        neg = zero | 0xC300  # -(2^7 + z)
        out = tl.inline_asm_elementwise(_INT4_PAIRS_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                                        [packed, neg | (neg << 16), 0x3F803F80],  # 1.0 twice
                                        dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        ints = in_k_order(out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7])
    else:
        neg = zero | 0xE400  # -(2^10 + z)
        neg_up = (zero << 4) | 0xD400  # -(2^6 + z): 64's ulp is 1/16, so z sits four bits up
        out = tl.inline_asm_elementwise(_INT4_PAIRS_F16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r",
                                        [packed, neg | (neg << 16), 0x3C003C00, neg_up | (neg_up << 16)],
                                        dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        ints = in_k_order(out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7])
    return ints


@triton.jit
def int4_integers(packed, z_ptr, offs_n, mask_n, group, stride_sn, stride_sk, HAS_ZP: tl.constexpr,
                  DOT: tl.constexpr):
    """q - z for every code of the [BLOCK_N, WORDS] words (`int4_differences`), with z group `group`'s zero points
    of rows offs_n; without zero points a symmetric code c is (c ^ 8) - 8."""
    if HAS_ZP:
        zero = tl.load(z_ptr + offs_n * stride_sn + group * stride_sk, mask=mask_n, other=0).to(tl.int32)
        return int4_differences(packed, zero[:, None], DOT)
    # 0x88888888 as int32 flips bit 3 of every nibble
    return int4_differences(packed ^ -0x77777778, tl.full((packed.shape[0], 1), 8, tl.int32), DOT)


# Outputs $0..$7 are codes 0..7 of word $8 minus z; $9 holds -(OFFSET + z) twice and $10 the float 1 twice. Pair j
# holds codes j (low half) and j + 4 (high half), nibbles 16 bits apart. OFFSET + q and the difference are exact
# in the 16-bit float, so the fma's rounding mode never applies.
_INT4_PAIRS_ASM = """
{
.reg .b32 w, p0, p1, p2, p3;
lop3.b32 p0, $8, 0x000f000f, OFFSET, 0xea;
shr.u32 w, $8, 4;
lop3.b32 p1, w, 0x000f000f, OFFSET, 0xea;
shr.u32 w, $8, 8;
lop3.b32 p2, w, 0x000f000f, OFFSET, 0xea;
shr.u32 w, $8, 12;
lop3.b32 p3, w, 0x000f000f, OFFSET, 0xea;
FMA p0, p0, $10, $9;
FMA p1, p1, $10, $9;
FMA p2, p2, $10, $9;
FMA p3, p3, $10, $9;
mov.b32 {$0, $4}, p0;
mov.b32 {$1, $5}, p1;
mov.b32 {$2, $6}, p2;
mov.b32 {$3, $7}, p3;
}
"""
_INT4_PAIRS_BF16 = tl.constexpr(_INT4_PAIRS_ASM.replace("OFFSET", "0x43004300").replace("FMA", "fma.rn.bf16x2"))
# fp16's 10-bit mantissa also holds the nibbles four bits up where they lie: ORed into 64.0 (ulp 1/16) they are
# 64 + q, and $11 holds -(64 + z) twice, so a word takes one shift, not three. Exact as above.
_INT4_PAIRS_F16 = tl.constexpr("""
{
.reg .b32 w, p0, p1, p2, p3;
lop3.b32 p0, $8, 0x000f000f, 0x64006400, 0xea;
lop3.b32 p1, $8, 0x00f000f0, 0x54005400, 0xea;
shr.u32 w, $8, 8;
lop3.b32 p2, w, 0x000f000f, 0x64006400, 0xea;
lop3.b32 p3, w, 0x00f000f0, 0x54005400, 0xea;
fma.rn.f16x2 p0, p0, $10, $9;
fma.rn.f16x2 p1, p1, $10, $11;
fma.rn.f16x2 p2, p2, $10, $9;
fma.rn.f16x2 p3, p3, $10, $11;
mov.b32 {$0, $4}, p0;
mov.b32 {$1, $5}, p1;
mov.b32 {$2, $6}, p2;
mov.b32 {$3, $7}, p3;
}
""")


@triton.jit
def e4m3_words(words, DOT: tl.constexpr):
    """[R, W] int32 words of four e4m3 codes each (byte j is code j) as their [R, 4 * W] values in DOT, in order.
    On the GPU (fp16) two codes go to fp16 at a time (`cvt.rn.f16x2.e4m3x2`, sm_89+; exact: e4m3 is a subset of
    fp16). The interpreter (fp32), which runs no PTX, converts byte by byte to the same values."""
    if DOT == tl.float16:
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_E4M3_QUADS_F16, "=h,=h,=h,=h,r", [words],
                                                   dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        c0, c1, c2, c3 = _e4m3_byte(words, 0, DOT), _e4m3_byte(words, 1, DOT), _e4m3_byte(words, 2, DOT), \
            _e4m3_byte(words, 3, DOT)
    # a join appends its pair index as the last dimension: pairing codes 2 apart, then 1 apart, puts code j at j
    return tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), (words.shape[0], words.shape[1] * 4))


@triton.jit
def _e4m3_byte(words, j: tl.constexpr, DOT: tl.constexpr):
    """Code j of each word as a DOT value; its NaN codes (S.1111.111) as NaN, which the interpreter's conversion
    would make +-480."""
    code = (words >> (8 * j)) & 255
    value = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(DOT)
    return tl.where((code & 127) == 127, float("nan"), value)


# Outputs $0..$3 are codes 0..3 of word $4 (byte j) in fp16; each cvt converts a 16-bit half's two codes, low to low.
_E4M3_QUADS_F16 = tl.constexpr("""
{
.reg .b16 lo, hi;
.reg .b32 p0, p1;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 p0, lo;
cvt.rn.f16x2.e4m3x2 p1, hi;
mov.b32 {$0, $1}, p0;
mov.b32 {$2, $3}, p1;
}
""")


# NVFP4's block scales are e4m3, at most 448: times 2^118 every one is a normal bf16 (448 x 2^118 < 2^127, 2^-9 x 2^118
# > 2^-126), so a single multiply by it applies both a code's 2^126 and its scale, leaving each value 2^-8 of itself
# (exact: a power of two, far from bf16's ends); the GEMM multiplies its fp32 sum by 2^8 with the global scale.
NVFP4_PRESCALE = tl.constexpr(2.0**118)
NVFP4_UNSCALE = tl.constexpr(2.0**8)


@triton.jit
def fp4_values(packed, raw, GROUP: tl.constexpr, DOT: tl.constexpr, FMT: tl.constexpr):
    """Each e2m1 code of the [BLOCK_N, WORDS] words times its block's scale, from the scale codes `raw` ([BLOCK_N,
    8 * WORDS / GROUP] int32: E8M0 for MXFP4, FMT 2; e4m3 for NVFP4, FMT 3): [BLOCK_N, 8 * WORDS] in DOT, K order,
    exact wherever the product is (an E8M0 or e4m3 scale times an e2m1 value has at most 6 significant bits).
    In bf16, two codes go at a time in PTX: each code's bits land in a bf16 pair's sign, exponent and mantissa
    fields, which is the value times 2^-126 (e2m1's subnormal 0.5 lands on a bf16 subnormal), and packed multiplies
    are exact. MXFP4: by 2^126, then by the scale, whose bf16 bits are its E8M0 code shifted into the exponent field
    (integer ops only); NVFP4: one multiply by the scale times NVFP4_PRESCALE (e4m3 scales are at most 448), which
    leaves every value times 2^-8, exactly. Elsewhere (fp16, whose range could clip a scale, and the interpreter's
    fp32) the value is formed in fp32 and rounded once."""
    BLOCK_N: tl.constexpr = packed.shape[0]
    WORDS: tl.constexpr = packed.shape[1]
    BLOCKS: tl.constexpr = WORDS * 8 // GROUP
    if DOT == tl.bfloat16:
        pair = tl.reshape(tl.broadcast_to(scale_bf16_pair(raw, FMT)[:, :, None], (BLOCK_N, BLOCKS, GROUP // 8)),
                          (BLOCK_N, WORDS))
        if FMT == 3:
            out = tl.inline_asm_elementwise(_FP4_PAIRS_BF16_PRESCALED, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [packed, pair],
                                            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        else:
            out = tl.inline_asm_elementwise(_FP4_PAIRS_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r",
                                            [packed, pair, 0x7E807E80], dtype=(tl.bfloat16,) * 8, is_pure=True,
                                            pack=1)
        values = in_k_order(out[0], out[1], out[2], out[3], out[4], out[5], out[6], out[7])
    else:
        values = tl.reshape(e2m1_value(split_words(packed)), (BLOCK_N, BLOCKS, GROUP))
        values = tl.reshape(values * scale_value(raw, FMT)[:, :, None], (BLOCK_N, WORDS * 8)).to(DOT)
    return values


@triton.jit
def scale_bf16_pair(raw, FMT: tl.constexpr):
    """The multiplier `fp4_values` applies in bf16, its bits in both halves of an int32: an E8M0 code's value (MXFP4,
    FMT 2), or an e4m3 code's times NVFP4_PRESCALE (NVFP4). 2^(e - 127) is bf16 exponent field e, mantissa 0, save
    the subnormal 2^-127 (code 0: mantissa 0x40) and NaN (code 255): a multiply and two selects, where the fp32
    route (the value, two selects, a conversion to bf16, then the halves) took 403 instructions a K step of the
    decode GEMM on sm_90 against 391 (`python -m bench.sass mxfp4`)."""
    if FMT == 2:
        return tl.where(raw == 0, 0x00400040, tl.where(raw == 255, 0x7FC07FC0, raw * 0x00800080))
    bits = (scale_value(raw, FMT) * NVFP4_PRESCALE).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    return (bits & 0xFFFF) * 0x10001  # the 16 bits in both halves, in one multiply


def fp4_pair_lines(dest: str, word: str, shift: int) -> list[str]:
    """PTX that decodes the e2m1 codes at nibble `shift` (0, 4, 8, 12) of `word` and the one 16 bits up into the
    bf16 pair `dest`, each the code's value times 2^-126: its exponent and mantissa bits (2..0) shift to bf16 bits
    8..6 and its sign (bit 3) to bit 15. Uses the scratch registers m and s."""
    toward = lambda bits: f"shl.b32 {{}}, {word}, {bits}" if bits > 0 else f"shr.u32 {{}}, {word}, {-bits}"
    lines = [toward(6 - shift).format("m") + ";", "and.b32 m, m, 0x01c001c0;"]
    sign = word
    if shift != 12:
        lines.append(toward(12 - shift).format("s") + ";")
        sign = "s"
    return lines + [f"lop3.b32 {dest}, {sign}, 0x80008000, m, 0xea;"]  # (sign & 0x80008000) | m


def _fp4_pairs_asm(multipliers: tuple[str, ...]) -> str:
    """Outputs $0..$7 are codes 0..7 of word $8 times each of `multipliers` (bf16 pairs), in order. Pair j holds
    codes j (low half) and j + 4 (high half) (`fp4_pair_lines`). Every multiply is exact, so its rounding mode never
    applies."""
    decode = [line for j in range(4) for line in fp4_pair_lines(f"p{j}", "$8", 4 * j)]
    multiplies = [f"mul.rn.bf16x2 p{j}, p{j}, {register};" for register in multipliers for j in range(4)]
    moves = [f"mov.b32 {{${j}, ${j + 4}}}, p{j};" for j in range(4)]
    return "\n".join(["{", ".reg .b32 m, s, p0, p1, p2, p3;", *decode, *multiplies, *moves, "}"])


_FP4_PAIRS_BF16 = tl.constexpr(_fp4_pairs_asm(("$10", "$9")))  # $10: 2^126 twice; $9: the scale twice
_FP4_PAIRS_BF16_PRESCALED = tl.constexpr(_fp4_pairs_asm(("$9",)))  # $9: the scale times 2^118, twice
