"""Host-side launch arithmetic in plain Python, and how a launch is seen while a package is compiled.

`triton.cdiv` and `triton.next_power_of_2` accept constexprs and cost microseconds per call through that wrapper;
a decode step computes grids for about a hundred launches, so the launchers use these instead.

Every launch goes through `visible(kernel)[grid](...)`: the kernel itself, except while `kernels_inlined()` is on
(fxquant.io.export.package), when it is `torch.library.wrap_triton(kernel)`, which tracing records as a call to that
kernel and Inductor compiles into its own code. Off, it costs one global read: wrap_triton's dispatch in eager mode
costs far more than a decode step's launch.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.library import wrap_triton

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


_inlined = [False]


def visible(kernel):
    """The kernel to launch: wrapped for tracing while kernels_inlined() is on, else the kernel itself."""
    return wrap_triton(kernel) if _inlined[0] else kernel


def inlined() -> bool:
    return _inlined[0]


@contextlib.contextmanager
def set_inside(cell: list, value):
    """cell[0] is `value` inside the block and what it was before after it: the module-level launch switches."""
    before, cell[0] = cell[0], value
    try:
        yield
    finally:
        cell[0] = before


def kernels_inlined():
    """While on, tracing (torch.export's functionalization, AOTInductor) sees into the fxquant ops: their torch ops
    and their Triton kernels, instead of opaque `fxquant::` calls."""
    return set_inside(_inlined, True)
