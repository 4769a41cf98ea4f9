"""bench.int4_chain's split rule: K cut toward a program count per GEMM, at least two K steps a slice."""

import sys

from bench.common import values_after
from bench.int4_chain import DEFAULT_STAGES, LAYER, split_toward


def test_k_is_cut_toward_the_program_count_and_keeps_two_steps_a_slice():
    assert [split_toward(n, k, 450) for n, k in LAYER] == [5, 7, 1, 7]  # 96, 64, 448 and 64 tiles of 64 rows
    assert [split_toward(n, k, 1800) for n, k in LAYER] == [16, 16, 4, 28]  # q/k/v and o: 32 K steps, 2 a slice
    assert split_toward(64, 256, 10_000) == 1  # two K steps: one slice


def test_a_flag_takes_the_values_up_to_the_next_flag_or_its_default(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["int4_chain", "--programs", "450", "900", "--stages", "4"])
    assert values_after("--programs", ()) == ["450", "900"] and values_after("--stages", ()) == ["4"]
    monkeypatch.setattr(sys, "argv", ["int4_chain"])
    assert values_after("--stages", DEFAULT_STAGES) == list(DEFAULT_STAGES)
