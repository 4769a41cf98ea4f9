"""In-kernel decoding of weight codes, shared by the weight-only GEMM and the weight dequantizer: packed 4-bit
words split into codes, integers made exact floats from bits, e2m1 values, and per-block scales."""

from __future__ import annotations

import triton
import triton.language as tl

FORMATS = {"int8": 0, "int4": 1, "mxfp4": 2, "nvfp4": 3}  # the FMT constexpr of the kernels that decode codes
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
def block_scale(s_ptr, offs_n, k_index, stride_sn, stride_sk, mask, FMT: tl.constexpr):
    """The per-(n, k-block) scales as fp32, from E8M0 (MXFP4) or e4m3 (NVFP4) codes."""
    raw = tl.load(s_ptr + offs_n * stride_sn + k_index * stride_sk, mask=mask, other=0)
    if FMT == 2:
        e = raw.to(tl.int32)
        value = (e << 23).to(tl.float32, bitcast=True)
        return tl.where(e == 0, E8M0_MIN, tl.where(e == 255, float("nan"), value))
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def nibbles(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] 4-bit codes of one K step, in K order, as int32. Packed rows are read as int32 words
    (nibble j of a little-endian word is code j of its 8), then split with joins, which keep each word's 8 codes
    in one thread: k = 4 * b2 + 2 * b1 + b0, and each join adds the next lower bit as the fastest dimension."""
    WORDS: tl.constexpr = BLOCK_K // 8
    word = step * WORDS + tl.arange(0, WORDS)
    mask = mask_n[:, None] if EVEN_K else mask_n[:, None] & (word[None, :] * 8 < K)
    packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + word[None, :], mask=mask, other=0)
    even = tl.join(tl.join(packed & 15, (packed >> 16) & 15), tl.join((packed >> 8) & 15, (packed >> 24) & 15))
    odd = tl.join(tl.join((packed >> 4) & 15, (packed >> 20) & 15), tl.join((packed >> 12) & 15, (packed >> 28) & 15))
    return tl.reshape(tl.join(even, odd), (offs_n.shape[0], BLOCK_K))


@triton.jit
def offset_int(n, DOT: tl.constexpr):
    """OFFSET + n exactly in DOT for 0 <= n < 16, with no int -> float conversion: n ORed into the mantissa of a
    power of two whose ulp is 1 (OFFSET = 2^7 in bf16, 2^10 in fp16, 2^23 in fp32). A difference of two such
    values is the exact difference of the integers."""
    if DOT == tl.bfloat16:
        value = (n | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif DOT == tl.float16:
        value = (n | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        value = biased(n)
    return value
