"""The launchers' plain-Python grid arithmetic agrees with Triton's own helpers, and a launch is traceable only
while a package compiles."""

import triton
from torch.library import wrap_triton

from fxquant.kernels.launch import cdiv, inlined, kernels_inlined, next_power_of_2, visible
from fxquant.kernels.quant_fp8 import _quant_fp8_rows_kernel


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in range(70000)] == [triton.next_power_of_2(n) for n in range(70000)]


def test_cdiv_matches_triton():
    pairs = [(a, b) for a in range(0, 2000, 7) for b in (1, 2, 3, 16, 64, 100, 128, 1024)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]


def test_a_launch_is_wrapped_for_tracing_only_while_kernels_are_inlined():
    assert visible(_quant_fp8_rows_kernel) is _quant_fp8_rows_kernel and not inlined()  # eager: the kernel itself
    with kernels_inlined():
        with kernels_inlined():
            # wrap_triton's wrapper where Triton compiles (TRITON_INTERPRET=1 leaves the kernel as it is)
            assert type(visible(_quant_fp8_rows_kernel)) is type(wrap_triton(_quant_fp8_rows_kernel))
        assert inlined()  # the inner exit restores the outer state
    assert not inlined()
