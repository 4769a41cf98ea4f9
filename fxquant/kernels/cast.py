"""The casts every kernel uses: fp32 -> fp8 and fp32 -> bf16/fp16, round-to-nearest-even, bit-exact with torch.

Three implementations, picked by the launcher through the CAST constexpr:
- CAST_NATIVE (sm_90+): `x.to(fp8)` lowers to cvt.rn.satfinite, which is correct there;
- CAST_PTX (sm_89): explicit cvt.rn.satfinite.{e4m3,e5m2}x2.f32, since Triton's lowering double-rounds there;
- CAST_EMULATED (TRITON_INTERPRET=1): integer bit manipulation, since the interpreter's own cast rounds
  about 2.4% of e4m3 values wrongly (127.3 -> 64 instead of 128).
Inputs must already be saturated to +-max; NaN maps to the format's NaN.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

CAST_NATIVE, CAST_PTX, CAST_EMULATED = 0, 1, 2


def interpreting(kernel) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (the choice is made at import time)."""
    return type(kernel).__name__ == "InterpretedFunction"


def cast_mode(kernel, device: torch.device) -> int:
    """The CAST constexpr for launching `kernel` on `device`."""
    if interpreting(kernel):
        return CAST_EMULATED
    if device.type != "cuda":
        raise RuntimeError(
            "fxquant: Triton kernels on the CPU need TRITON_INTERPRET=1 set before fxquant is imported; "
            "or use impl='reference'"
        )
    cap = capability(device)
    if cap >= (9, 0):
        return CAST_NATIVE
    if cap >= (8, 9):
        return CAST_PTX
    raise RuntimeError(
        f"fxquant: fp8 kernels need compute capability >= 8.9, this GPU is sm_{cap[0]}{cap[1]}; "
        "use a weight-only recipe (int8_wo, int4_wo) or impl='reference'"
    )


def capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, asked once per device: every kernel launch needs it."""
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def float_cast_mode(kernel) -> int:
    """The CAST constexpr for a kernel whose only narrowing casts are cast_float's (any GPU)."""
    return CAST_EMULATED if interpreting(kernel) else CAST_NATIVE


@triton.jit
def cast_fp8(x, FP8: tl.constexpr, CAST: tl.constexpr):
    """fp32 x (saturated; NaN allowed) -> FP8 (tl.float8e4nv or tl.float8e5), round-to-nearest-even."""
    if CAST == 0:
        return x.to(FP8)
    elif CAST == 1:
        return _cast_fp8_ptx(x, FP8)
    else:
        if FP8 == tl.float8e4nv:
            bits = _e4m3_bits(x)
        else:
            bits = _e5m2_bits(x)
        return bits.to(FP8, bitcast=True)


@triton.jit
def cast_float(x, DTYPE: tl.constexpr, CAST: tl.constexpr):
    """fp32 x -> DTYPE (bf16, fp16 or fp32), round-to-nearest-even. The interpreter's own conversion to bf16
    truncates (about half of all values come out 1 ulp low) and mangles fp32 subnormals, so there the bf16 bits
    are made from the fp32 bits."""
    if CAST == 2 and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        # Add half an ulp of bf16, plus one where the kept lsb is odd (ties to even); NaN becomes torch's 0x7FC0.
        rounded = tl.where(x == x, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16, 0x7FC0)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _cast_fp8_ptx(x, FP8: tl.constexpr):
    # cvt d, a, b puts a in d's upper byte: pass the second element first so element 0 is the low byte.
    if FP8 == tl.float8e4nv:
        bits = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4,
        )
    else:
        bits = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,r,r,r,r", [x], dtype=tl.uint8, is_pure=True, pack=4,
        )
    return bits.to(FP8, bitcast=True)


@triton.jit
def _e4m3_bits(x):
    # e4m3fn: bias 7, 3 mantissa bits, min normal 2**-6, subnormal step 2**-9, NaN code 0x7F.
    return _minifloat_bits(x, 20, 0x7FFFF, (127 - 7) << 3, 0.015625, 512.0, 0x7F)


@triton.jit
def _e5m2_bits(x):
    # e5m2: bias 15, 2 mantissa bits, min normal 2**-14, subnormal step 2**-16, NaN code 0x7F.
    return _minifloat_bits(x, 21, 0xFFFFF, (127 - 15) << 2, 0.00006103515625, 65536.0, 0x7F)


@triton.jit
def _minifloat_bits(x, SHIFT: tl.constexpr, HALF_MINUS_ONE: tl.constexpr, REBIAS: tl.constexpr,
                    MIN_NORMAL: tl.constexpr, SUB_UNITS: tl.constexpr, NAN_CODE: tl.constexpr):
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: round-to-nearest-even on the fp32 bits (add half-ulp - 1 plus the kept lsb, truncate);
    # a mantissa carry rolls into the exponent, which is right.
    rounded = mag + HALF_MINUS_ONE + ((mag >> SHIFT) & 1)
    normal = (rounded >> SHIFT) - REBIAS
    # Subnormal range: scaling by a power of two is exact, and adding then subtracting 2**23 rounds to an
    # integer with IEEE round-to-nearest-even; a carry to 2**mbits lands on the min normal code.
    is_sub = mag.to(tl.float32, bitcast=True) < MIN_NORMAL
    units = tl.where(is_sub, mag.to(tl.float32, bitcast=True) * SUB_UNITS, 0.0)
    sub = ((units + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(is_sub, sub, normal)
    code = tl.where(mag > 0x7F800000, NAN_CODE, code)
    return (code | sign).to(tl.uint8)
