"""The format table: every limit derived from (exponent bits, mantissa bits, special-value policy).

Nothing here is typed in by hand; tests compare each derived figure with `torch.finfo` and `ml_dtypes`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Specials(enum.Enum):
    """Which codes are not finite numbers."""

    IEEE = "ieee"  # the top exponent holds inf (mantissa 0) and NaN (e5m2, fp16, bf16)
    FN = "fn"  # finite only; the single all-ones code is NaN (e4m3fn, e8m0fnu)
    NONE = "none"  # every code is a finite number (e2m1)


@dataclass(frozen=True)
class FloatFormat:
    name: str
    ebits: int
    mbits: int
    specials: Specials
    signed: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def bits(self) -> int:
        return self.ebits + self.mbits + int(self.signed)

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def exponent_only(self) -> bool:
        # e8m0: no mantissa, no implicit bit, no zero, no subnormals: the code is the exponent.
        return self.mbits == 0

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite value."""
        top = 2**self.ebits - 1
        if self.specials is Specials.IEEE or (self.specials is Specials.FN and self.mbits == 0):
            top -= 1  # the top exponent field holds no finite value
        return top - self.bias

    @property
    def max(self) -> float:
        mant_ulps = 2**self.mbits - 1  # all-ones mantissa
        if self.specials is Specials.FN and self.mbits > 0:
            mant_ulps -= 1  # the all-ones code is NaN
        return (1 + mant_ulps / 2**self.mbits) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0 ** (-self.bias if self.exponent_only else 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return self.min_normal * 2.0**-self.mbits

    @property
    def eps(self) -> float:
        return 2.0**-self.mbits

    @property
    def max_mantissa(self) -> float:
        """Significand of `max` in [1, 2): the MX scale rules compare a block's amax against it."""
        return self.max / 2.0**self.emax

    @property
    def nan_code(self) -> int | None:
        if self.specials is Specials.NONE:
            return None
        return 2 ** (self.ebits + self.mbits) - 1


@dataclass(frozen=True)
class IntFormat:
    name: str
    bits: int
    signed: bool
    torch_dtype: torch.dtype | None = None

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.signed else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.signed else 2**self.bits - 1

    @property
    def max(self) -> float:
        return float(self.qmax)


E4M3 = FloatFormat("e4m3fn", 4, 3, Specials.FN, torch_dtype=torch.float8_e4m3fn)
E5M2 = FloatFormat("e5m2", 5, 2, Specials.IEEE, torch_dtype=torch.float8_e5m2)
E2M1 = FloatFormat("e2m1", 2, 1, Specials.NONE)
E8M0 = FloatFormat("e8m0fnu", 8, 0, Specials.FN, signed=False, torch_dtype=torch.float8_e8m0fnu)
UE4M3 = FloatFormat("ue4m3", 4, 3, Specials.FN, signed=False, torch_dtype=torch.float8_e4m3fn)
BF16 = FloatFormat("bf16", 8, 7, Specials.IEEE, torch_dtype=torch.bfloat16)
FP16 = FloatFormat("fp16", 5, 10, Specials.IEEE, torch_dtype=torch.float16)
INT8 = IntFormat("int8", 8, True, torch.int8)
INT4 = IntFormat("int4", 4, True)
UINT4 = IntFormat("uint4", 4, False)

FORMATS: dict[str, FloatFormat | IntFormat] = {
    f.name: f for f in (E4M3, E5M2, E2M1, E8M0, UE4M3, BF16, FP16, INT8, INT4, UINT4)
}

# Every scale's amax is floored here (a minimum fp8 scale of 1/(448*512), as vLLM uses): an all-zero
# row or block then quantizes to exact zeros, never 0/0 = NaN.
AMAX_FLOOR = 2.0**-9


def apply_scale(xb: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """xb / scale, per block, as kernels compute it: one IEEE reciprocal per block, then exact multiplies."""
    return xb * (torch.ones_like(scale) / scale)[..., None]


def fdiv(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b with IEEE division on every device: CUDA would turn a Python-scalar divisor into a multiply by
    its rounded reciprocal, and the reference must round the same on the CPU, on CUDA and in the kernels."""
    return a / torch.full_like(a, b)
