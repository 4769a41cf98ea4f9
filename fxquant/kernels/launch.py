"""Host-side launch arithmetic in plain Python.

`triton.cdiv` and `triton.next_power_of_2` accept constexprs and cost microseconds per call through that wrapper;
a decode step computes grids for about a hundred launches, so the launchers use these instead.
"""

from __future__ import annotations

import functools

import torch

FITTED_SMS = 132  # the H200's SM count, used where there is no GPU to ask (the interpreter), so CPU runs plan alike


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's SM count, asked once; FITTED_SMS off the GPU."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else FITTED_SMS
