"""The launchers' plain-Python grid arithmetic agrees with Triton's own helpers."""

import triton

from fxquant.kernels.launch import cdiv, next_power_of_2


def test_next_power_of_2_matches_triton():
    assert [next_power_of_2(n) for n in range(70000)] == [triton.next_power_of_2(n) for n in range(70000)]


def test_cdiv_matches_triton():
    pairs = [(a, b) for a in range(0, 2000, 7) for b in (1, 2, 3, 16, 64, 100, 128, 1024)]
    assert [cdiv(a, b) for a, b in pairs] == [triton.cdiv(a, b) for a, b in pairs]
