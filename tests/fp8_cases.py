"""Inputs that exercise every rounding case of an fp8 cast."""

import torch

from fxquant.numerics.formats import FloatFormat
from fxquant.numerics.minifloat import decode


def grid(fmt: FloatFormat) -> torch.Tensor:
    """Every finite non-negative value of `fmt`, sorted."""
    values = decode(torch.arange(2 ** (fmt.ebits + fmt.mbits)), fmt)
    return values[torch.isfinite(values)].unique()


def rounding_cases(fmt: FloatFormat) -> torch.Tensor:
    """Grid values, midpoints, midpoints +-1 fp32 ulp, subnormals, +-0, beyond max, NaN and inf; both signs."""
    g = grid(fmt)
    mid = (g[1:] + g[:-1]) / 2  # exact in fp32: neighbours differ in few bits
    up, down = torch.nextafter(mid, torch.tensor(float("inf"))), torch.nextafter(mid, torch.tensor(0.0))
    sub = torch.linspace(0, fmt.min_normal, 1001)
    big = torch.tensor([fmt.max * 1.01, fmt.max * 1.0625, fmt.max * 1.124, fmt.max * 2, 1e30, 3.0e38])
    pos = torch.cat([g, mid, up, down, sub, big, torch.tensor([float("inf")])])
    return torch.cat([pos, -pos, torch.tensor([float("nan"), -0.0])])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> int:
    """Mismatch count between two float tensors of one width: bits must agree (signed zeros included), except that
    any NaN matches any NaN."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    both_nan = torch.isnan(a.float()) & torch.isnan(b.float())
    return int(((a.view(ints) != b.view(ints)) & ~both_nan).sum())
