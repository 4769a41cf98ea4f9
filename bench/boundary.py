"""What a boundary between dependent phases of decode costs: a kernel launch, with or without programmatic dependent
launch, against a grid-wide barrier inside one persistent kernel: what putting a decode step's kernels on one
persistent grid could save, measured before such a kernel is written.

Every variant reads the same chain of phases: 32 layers of a Llama-3-8B layer's four weights (merged q/k/v, o, merged
gate/up, down) as int4 codes (N x K / 2 bytes) or as e4m3 (N x K), each its own bytes, far past the L2. In a phase,
every program reads its share of the phase's words (FLAT_WORDS a step, grid-strided, `read_floor.read_flat`'s loop),
then reads one value the phase before wrote (another program's), and writes one value: each phase depends on the
one before, as a decode layer's GEMMs do on their activations, and the weights on nothing.

- "one flat read": all phases' bytes read by one kernel, no boundary: the floor;
- "kernels": a kernel a phase, launched one after the other;
- "kernels, dependent launch": launched with PDL, each program waiting for the phase before at its start and letting
  the next kernel launch after its reads, as the decode GEMMs do;
- "kernels, dependent launch, first steps asked of the L2": the same, each program first asking the L2 for its first
  PREFETCH_STEPS steps before it waits, as the fp8 decode GEMM does;
- "kernels, dependent launch, reads before the wait": each program reads its whole share before it waits, which only
  weights allow: the most dependent launch could hide;
- "one kernel, grid barriers": one launch of as many programs as the GPU holds at once, the phases separated by a
  barrier on a counter in global memory (every program adds one, then polls until all have);
- "one kernel, grid barriers, next steps asked of the L2": each program asks the L2 for its first steps of the next
  phase before it arrives at the barrier;
- "one kernel, grid barriers polled by loads": the barrier's waiting programs read the counter with volatile loads
  instead of atomic read-modify-writes, which queue at the counter's L2 slice behind the arrivals, and acquire once.

Each variant's values equal the same chain computed by torch (`reference`). The table gives each variant's time, its
bytes over that time against the copy bandwidth, and what it spends a phase beyond the flat read.

Run: python -m bench.boundary [--weights int4 fp8] [--programs-per-sm 1 2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth_gbs, header, table
from bench.int4_chain import LAYER, LAYERS
from bench.read_floor import FLAT_WORDS, read_flat
from fxquant.kernels.dependent_launch import (
    PREFETCH_STEPS,
    await_previous,
    launch_options,
    prefetch_l2,
    start_next,
)
from fxquant.kernels.launch import cdiv

BYTES_PER_ELEMENT = {"int4": 0.5, "fp8": 1}
SPINS = tl.constexpr(1 << 24)  # polls of a barrier's counter before a program gives up (one never resident)
STALLED = tl.constexpr(-(1 << 31))  # what a program that gave up at a barrier writes from then on


@triton.jit
def _share(x_ptr, words, WORDS: tl.constexpr, STAGES: tl.constexpr):
    """This program's share of a phase's words: steps pid, pid + programs, ... of WORDS words, summed (wrapping)."""
    total = tl.zeros((WORDS,), tl.int32)
    offsets = tl.arange(0, WORDS)
    for start in tl.range(tl.program_id(0) * WORDS, words, tl.num_programs(0) * WORDS, num_stages=STAGES):
        where = offsets.to(tl.int64) + start
        total += tl.load(x_ptr + where, mask=where < words, other=0)
    return tl.sum(total)


@triton.jit
def _ask_l2(x_ptr, words, WORDS: tl.constexpr):
    """Ask the L2 for this program's first PREFETCH_STEPS steps of a phase's words: 128-byte lines, one a thread."""
    steps = tl.program_id(0) + tl.num_programs(0) * tl.arange(0, PREFETCH_STEPS)
    line = steps[:, None].to(tl.int64) * WORDS + tl.arange(0, WORDS // 32)[None, :] * 32  # 32 words a line
    prefetch_l2(x_ptr + tl.minimum(line, words - 1))


@triton.jit
def _link(prev_ptr, out_ptr, value, FIRST: tl.constexpr):
    """Store value plus what the next program stored in the phase before (nothing before the first phase)."""
    pid = tl.program_id(0)
    if not FIRST:
        value += tl.load(prev_ptr + (pid + 1) % tl.num_programs(0), cache_modifier=".cg")  # another SM wrote it
    tl.store(out_ptr + pid, value)


@triton.jit
def _phase_kernel(x_ptr, prev_ptr, out_ptr, words, FIRST: tl.constexpr, READ_FIRST: tl.constexpr,
                  ASK_L2: tl.constexpr, PDL: tl.constexpr, WORDS: tl.constexpr, STAGES: tl.constexpr):
    if READ_FIRST:  # the weights depend on no kernel: read them all, then wait for the phase before
        value = _share(x_ptr, words, WORDS, STAGES)
        await_previous(PDL)
    else:
        if ASK_L2:
            _ask_l2(x_ptr, words, WORDS)
        await_previous(PDL)
        value = _share(x_ptr, words, WORDS, STAGES)
    start_next(PDL)
    _link(prev_ptr, out_ptr, value, FIRST)


@triton.jit
def _count(count_ptr, POLL_LOADS: tl.constexpr):
    """A grid barrier's count as a waiting program reads it: a volatile load, or an acquiring atomic read."""
    if POLL_LOADS:
        return tl.load(count_ptr, volatile=True)
    return tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _arrive_and_wait(count_ptr, target, POLL_LOADS: tl.constexpr):
    """A grid barrier: count this program in, then poll until `target` programs have, by atomic reads (each one a
    read-modify-write of the counter the arrivals add to) or, with POLL_LOADS, by volatile loads and one acquiring
    read once the count is reached. Returns 1 where it gave up after SPINS polls (a program that never became
    resident would hold the rest forever), else 0."""
    tl.debug_barrier()  # every thread's stores are issued before the count releases them
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")
    seen = _count(count_ptr, POLL_LOADS)
    spins = seen * 0
    while (seen < target) & (spins < SPINS):
        seen = _count(count_ptr, POLL_LOADS)
        spins += 1
    if POLL_LOADS:  # the writes the count released are visible after an acquiring read of it
        tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    return (seen < target).to(tl.int32)


@triton.jit
def _phases_kernel(x_ptr, starts_ptr, out_ptr, count_ptr, phases, ASK_L2: tl.constexpr, POLL_LOADS: tl.constexpr,
                   WORDS: tl.constexpr, STAGES: tl.constexpr):
    programs = tl.num_programs(0)
    pid = tl.program_id(0)
    gave_up = pid * 0
    for phase in range(phases):
        start = tl.load(starts_ptr + phase)
        words = tl.load(starts_ptr + phase + 1) - start
        value = _share(x_ptr + start, words, WORDS, STAGES)
        if phase > 0:
            value += tl.load(out_ptr + (phase - 1) * programs + (pid + 1) % programs, cache_modifier=".cg")
        tl.store(out_ptr + phase * programs + pid, tl.where(gave_up == 0, value, STALLED))
        if ASK_L2 and phase + 1 < phases:
            following = tl.load(starts_ptr + phase + 1)
            _ask_l2(x_ptr + following, tl.load(starts_ptr + phase + 2) - following, WORDS)
        gave_up += _arrive_and_wait(count_ptr, (phase + 1) * programs, POLL_LOADS)


def phase_words(weights: str, layers: int = LAYERS, scale: int = 1) -> list[int]:
    """The int32 words of each phase: a layer's four weights in `weights`' bytes, `layers` times, each weight's
    elements divided by `scale` (the tests' small chains)."""
    return [int(n * k * BYTES_PER_ELEMENT[weights]) // 4 // scale for _ in range(layers) for n, k in LAYER]


def split_words(words: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The phases' words as views of one buffer."""
    return list(words[:sum(sizes)].split(sizes))


def reference(phases: list[torch.Tensor], programs: int) -> torch.Tensor:
    """The chain's values [phases, programs] by torch: each program's share of a phase (steps pid + programs j of
    FLAT_WORDS words), summed in int64 and wrapped to int32, plus the next program's value of the phase before."""
    out, before = [], torch.zeros(programs, dtype=torch.int64, device=phases[0].device)
    for x in phases:
        steps = torch.zeros(cdiv(x.numel(), FLAT_WORDS * programs) * FLAT_WORDS * programs, dtype=torch.int64,
                            device=x.device)
        steps[:x.numel()] = x
        share = steps.view(-1, programs, FLAT_WORDS).sum(dim=(0, 2))
        before = _wrap(share + before.roll(-1))
        out.append(before)
    return torch.stack(out).to(torch.int32)


def _wrap(x: torch.Tensor) -> torch.Tensor:
    return (x + 2**31) % 2**32 - 2**31


def kernel_chain(phases: list[torch.Tensor], out: torch.Tensor, *, pdl: bool, ask_l2: bool = False,
                 read_first: bool = False, stages: int = 3) -> torch.Tensor:
    """A kernel a phase, each of out's [phases, programs] rows written by its phase's programs."""
    options = launch_options(out.device) if pdl else {"PDL": False}
    for i, x in enumerate(phases):
        _phase_kernel[(out.shape[1],)](x, out[i - 1] if i else out[0], out[i], x.numel(), FIRST=i == 0,
                                       READ_FIRST=read_first, ASK_L2=ask_l2, WORDS=FLAT_WORDS, STAGES=stages,
                                       num_warps=4, num_stages=stages, **options)
    return out


def persistent(words: torch.Tensor, starts: torch.Tensor, out: torch.Tensor, count: torch.Tensor, *,
               ask_l2: bool = False, poll_loads: bool = False, stages: int = 3) -> torch.Tensor:
    """One kernel of out.shape[1] programs over every phase (words[starts[i]:starts[i + 1]]), a grid barrier on
    `count` (zeroed here) between phases, polled by atomic reads or by loads."""
    count.zero_()
    _phases_kernel[(out.shape[1],)](words, starts, out, count, starts.numel() - 1, ASK_L2=ask_l2,
                                    POLL_LOADS=poll_loads, WORDS=FLAT_WORDS, STAGES=stages, num_warps=4,
                                    num_stages=stages)
    return out


def variants(words: torch.Tensor, sizes: list[int], programs: int) -> dict:
    """Each variant as a function of its output [phases, programs] (the flat read's: one value a program)."""
    phases = split_words(words, sizes)
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64, device=words.device)
    count = torch.zeros(1, dtype=torch.int32, device=words.device)
    flat = words[:sum(sizes)]
    return {
        "one flat read": lambda out: read_flat(flat, programs=programs),
        "kernels": lambda out: kernel_chain(phases, out, pdl=False),
        "kernels, dependent launch": lambda out: kernel_chain(phases, out, pdl=True),
        "kernels, dependent launch, first steps asked of the L2": lambda out: kernel_chain(phases, out, pdl=True,
                                                                                         ask_l2=True),
        "kernels, dependent launch, reads before the wait": lambda out: kernel_chain(phases, out, pdl=True,
                                                                                   read_first=True),
        "one kernel, grid barriers": lambda out: persistent(words, starts, out, count),
        "one kernel, grid barriers, next steps asked of the L2": lambda out: persistent(words, starts, out, count,
                                                                                      ask_l2=True),
        "one kernel, grid barriers polled by loads": lambda out: persistent(words, starts, out, count,
                                                                          poll_loads=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weights", nargs="+", default=["int4", "fp8"], choices=sorted(BYTES_PER_ELEMENT))
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    print(header())
    bandwidth = copy_bandwidth_gbs()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for weights in args.weights:
        sizes = phase_words(weights)
        words = torch.randint(0, 1000, (sum(sizes),), dtype=torch.int32, device="cuda")
        for per_sm in args.programs_per_sm:
            programs = per_sm * sms
            expected = reference(split_words(words, sizes), programs)
            floor_ms = None
            for name, run in variants(words, sizes, programs).items():
                out = torch.empty((len(sizes), programs), dtype=torch.int32, device="cuda")
                got = run(out)
                torch.cuda.synchronize()
                if name == "one flat read":
                    assert int(got.sum(dtype=torch.int64)) % 2**32 == int(words.sum(dtype=torch.int64)) % 2**32
                else:
                    assert torch.equal(out, expected), f"{weights}, {programs} programs, {name}: wrong values"
                ms = triton.testing.do_bench_cudagraph(lambda r=run, o=out: r(o), rep=200, return_mode="median")
                floor_ms = floor_ms or ms
                rows.append({"weights": weights, "programs": programs, "variant": name, "ms": f"{ms:.3f}",
                             "% copy": f"{100 * words.nbytes / ms / 1e6 / bandwidth:.0f}",
                             "us a phase past the flat read": f"{1e3 * (ms - floor_ms) / len(sizes):.2f}"})
                print(rows[-1], flush=True)
        del words
        torch.cuda.empty_cache()
    print(f"{LAYERS} layers x {len(LAYER)} phases, one CUDA graph a variant; copy bandwidth {bandwidth:.0f} GB/s")
    print(table(rows))


if __name__ == "__main__":
    main()
