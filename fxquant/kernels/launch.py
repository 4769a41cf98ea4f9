"""Host-side launch arithmetic in plain Python.

`triton.cdiv` and `triton.next_power_of_2` accept constexprs and cost microseconds per call through that wrapper;
a decode step computes grids for about a hundred launches, so the launchers use these instead.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
