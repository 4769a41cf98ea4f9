"""bench.timeline: a step's span, busy time and gaps from its kernels' intervals, overlapping kernels (launched
dependent) counted once, and the steps told apart by their windows on the GPU."""

import pytest

from bench.timeline import Kernel, largest_gaps, step_timeline, steps_timeline, summary


def test_a_step_with_a_gap_and_an_overlap():
    kernels = [Kernel("gemm", 10.0, 20.0), Kernel("norm", 19.0, 24.0),  # overlaps the GEMM by 1 us
               Kernel("inside", 12.0, 15.0),  # within the GEMM: no gap after it
               Kernel("attention", 27.5, 30.0)]  # 3.5 us after the norm ended
    step = step_timeline(list(reversed(kernels)))
    assert step.span_us == 20.0 and step.busy_us == 16.5 and step.idle_us == pytest.approx(3.5)
    assert step.gaps == [(3.5, "norm", "attention")]


def test_steps_split_by_their_windows_and_summed_per_step():
    first = [Kernel("a", 0.0, 4.0), Kernel("b", 6.0, 10.0)]
    second = [Kernel("a", 100.0, 104.0), Kernel("b", 104.5, 108.0)]
    timelines = steps_timeline(second + first, [(0.0, 50.0), (100.0, 150.0)], steps=2)
    assert [t.span_us for t in timelines] == [10.0, 8.0] and [t.idle_us for t in timelines] == [2.0, 0.5]
    assert summary(timelines, steps=2) == {"span ms": "0.009", "idle ms": "0.001", "gaps >= 1 us": "0"}
    assert summary(timelines, steps=2, threshold_us=0.5) == {"span ms": "0.009", "idle ms": "0.001",
                                                             "gaps >= 0.5 us": "1"}
    assert largest_gaps(timelines).splitlines()[0].split() == ["2.00", "us", "a", "->", "b"]


def test_without_windows_one_timeline_spans_every_step():
    kernels = [Kernel("a", 0.0, 4.0), Kernel("a", 10.0, 14.0)]
    (whole,) = steps_timeline(kernels, [], steps=2)
    assert whole.span_us == 14.0 and whole.idle_us == 6.0
    assert summary([whole], steps=2)["idle ms"] == "0.003"
