"""Pure-torch rounding, encoding and packing for small float and int formats.

Independent of torch's own fp8 casts, so tests can check those casts (and the kernels) against it.
"""

from __future__ import annotations

import torch

from fxquant.numerics.formats import FloatFormat, Specials


def pow2(e: torch.Tensor) -> torch.Tensor:
    """Exact 2**e in fp32 for integer e in [-149, 127], subnormal results included."""
    e = e.to(torch.int32)
    half = torch.div(e, 2, rounding_mode="floor")
    # Two normal powers of two multiply exactly, even into the subnormal range.
    return _normal_pow2(half) * _normal_pow2(e - half)


def _normal_pow2(e: torch.Tensor) -> torch.Tensor:
    return ((e + 127) << 23).view(torch.float32)


def floor_log2(ax: torch.Tensor) -> torch.Tensor:
    """floor(log2(ax)) for positive finite fp32 ax (subnormals included), as int32."""
    _, e = torch.frexp(ax)  # ax = m * 2**e with m in [0.5, 1)
    return e.to(torch.int32) - 1


def round_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round fp32 `x` to `fmt`'s grid, round-to-nearest-even, subnormals included.

    Expects |x| <= fmt.max (the callers saturate first); NaN stays NaN.
    """
    ax = x.abs()
    exp = floor_log2(torch.where(ax > 0, ax, 1.0)).clamp_min(1 - fmt.bias)  # subnormals share emin's ulp
    ulp = pow2(exp - fmt.mbits)
    # x / ulp and the product are exact (powers of two); torch.round is round-half-to-even.
    return torch.round(x / ulp) * ulp


def encode(v: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Codes (int32) of values `v` that already lie on `fmt`'s grid; NaN gets the format's NaN code."""
    av = v.abs()
    sub = av < fmt.min_normal
    e = floor_log2(torch.where(sub | (av == 0), fmt.min_normal, av))
    mant_sub = av / fmt.min_subnormal
    mant_norm = (av / pow2(e) - 1) * 2**fmt.mbits
    exp_field = torch.where(sub, 0, e + fmt.bias)
    code = (exp_field << fmt.mbits) | torch.where(sub, mant_sub, mant_norm).to(torch.int32)
    code = code | (torch.signbit(v).to(torch.int32) << (fmt.ebits + fmt.mbits))
    nan = torch.isnan(v)
    if nan.any():
        if fmt.nan_code is None:
            raise ValueError(f"fxquant: {fmt.name} has no NaN code")
        code = torch.where(nan, fmt.nan_code, code)
    return code


def decode(code: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """fp32 values of `fmt` codes."""
    code = code.to(torch.int32)
    field_bits = fmt.ebits + fmt.mbits
    mag = code & (2**field_bits - 1)
    exp_field = mag >> fmt.mbits
    mant = (mag & (2**fmt.mbits - 1)).to(torch.float32)
    normal = (1 + mant * 2.0**-fmt.mbits) * pow2(exp_field - fmt.bias)
    # an exponent-only format (E8M0) has no subnormals: its code 0 is 2^-bias, not 0
    value = torch.where(exp_field == 0, mant * fmt.min_subnormal, normal) if fmt.mbits else normal
    if fmt.specials is Specials.IEEE:
        top = exp_field == 2**fmt.ebits - 1
        value = torch.where(top, torch.where(mant == 0, torch.inf, torch.nan), value)
    elif fmt.specials is Specials.FN:
        value = torch.where(mag == fmt.nan_code, torch.nan, value)
    if fmt.signed:
        value = torch.where(((code >> field_bits) & 1).bool(), -value, value)
    return value


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., K/2] uint8, element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"fxquant: packing two 4-bit codes per byte needs an even last dim, got {codes.shape[-1]}")
    codes = codes.to(torch.uint8) & 0xF
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] uint8 -> [..., K] uint8 codes in 0..15."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
