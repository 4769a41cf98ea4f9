"""Where a decode step's GPU time goes between its kernels: the kernels' own time against the step's span on the GPU,
and the bubbles between them. A profile gives every kernel's start and end; a step's span runs from its first
kernel's start to its last kernel's end, its busy time is the union of its kernels' intervals (kernels launched
dependent overlap), and what the span holds beyond the busy time is idle: launch latency and waits between dependent
kernels, which programmatic dependent launch exists to hide."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    end_us: float


@dataclass
class StepTimeline:
    span_us: float  # first start to last end
    busy_us: float  # the union of the kernels' intervals
    gaps: list[tuple[float, str, str]]  # (idle us, the kernel before, the kernel after), largest first

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def step_timeline(kernels: list[Kernel]) -> StepTimeline:
    """The span, busy time and gaps of one step's kernels (any order)."""
    ordered = sorted(kernels, key=lambda k: (k.start_us, k.end_us))
    busy, gaps = 0.0, []
    start, end, last = ordered[0].start_us, ordered[0].end_us, ordered[0]
    for kernel in ordered[1:]:
        if kernel.start_us > end:  # nothing ran between `last` ended and this one started
            busy += end - start
            gaps.append((kernel.start_us - end, last.name, kernel.name))
            start = kernel.start_us
        if kernel.end_us >= end:
            end, last = kernel.end_us, kernel
    busy += end - start
    gaps.sort(key=lambda gap: -gap[0])
    return StepTimeline(end - ordered[0].start_us, busy, gaps)


def steps_timeline(kernels: list[Kernel], windows: list[tuple[float, float]], steps: int) -> list[StepTimeline]:
    """The timeline of each step: the kernels that start within each window (a step's range on the GPU, such as
    Inductor's "## Call CompiledFxGraph" annotation); without windows, one timeline of every kernel, whose span and
    idle time count the steps' time between them too, spread over `steps` by `summary`."""
    if not windows:
        return [step_timeline(kernels)] if kernels else []
    inside = [[k for k in kernels if start <= k.start_us < end] for start, end in windows]
    return [step_timeline(group) for group in inside if group]


def summary(timelines: list[StepTimeline], steps: int, threshold_us: float = 1.0) -> dict[str, str]:
    """Per step (the timelines' totals over `steps`): span and idle ms, and the gaps of at least `threshold_us`."""
    gaps = sum(gap[0] >= threshold_us for t in timelines for gap in t.gaps)
    return {"span ms": f"{sum(t.span_us for t in timelines) / steps / 1e3:.3f}",
            "idle ms": f"{sum(t.idle_us for t in timelines) / steps / 1e3:.3f}",
            f"gaps >= {threshold_us:g} us": f"{gaps / steps:.0f}"}


def largest_gaps(timelines: list[StepTimeline], count: int = 8) -> str:
    """The largest gaps of the steps, with the kernels around them, one per line."""
    gaps = sorted((gap for t in timelines for gap in t.gaps), key=lambda gap: -gap[0])[:count]
    return "\n".join(f"{us:8.2f} us  {before[:60]} -> {after[:60]}" for us, before, after in gaps)
