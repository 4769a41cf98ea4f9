"""bench.boundary's chains compute what torch computes of the same phases (each program's share of a phase's words,
plus the next program's value of the phase before), a kernel a phase or one kernel with a grid barrier between
phases, and compile for sm_90 (with the L2 requests, which only the GPU runs)."""

import pytest
import torch

from bench.boundary import kernel_chain, persistent, phase_words, reference, split_words
from bench.read_floor import FLAT_WORDS
from tests.sm90_compile import compile_errors, recorded_launches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launches are the ones recorded")


def test_the_phases_of_a_layer_are_its_four_weights_in_int32_words():
    assert phase_words("fp8", layers=1) == [6144 * 1024, 4096 * 1024, 28672 * 1024, 4096 * 3584]
    assert phase_words("int4", layers=2, scale=1024) == [3072, 2048, 14336, 7168] * 2


def test_each_chain_gives_torch_s_values_and_compiles_for_sm90():
    sizes = phase_words("int4", layers=1, scale=2048)  # 1536, 1024, 7168 and 3584 words: one to two steps a program
    words = torch.randint(0, 1000, (sum(sizes) + 9,), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    phases = split_words(words, sizes)
    assert sizes[2] > FLAT_WORDS and [p.numel() for p in phases] == sizes
    expected = {programs: reference(phases, programs) for programs in (1, 3)}
    assert not torch.equal(expected[3][1], expected[3][1].roll(1))  # the programs' values differ: the link shows
    starts = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int64)
    with recorded_launches() as launches:
        chained = {read_first: kernel_chain(phases, torch.empty((4, 3), dtype=torch.int32), pdl=True,
                                            read_first=read_first) for read_first in (False, True)}
        barriers = {poll: persistent(words, starts, torch.empty((4, 1), dtype=torch.int32),
                                     torch.ones(1, dtype=torch.int32), poll_loads=poll) for poll in (False, True)}
    assert torch.equal(chained[False], expected[3]) and torch.equal(chained[True], expected[3])
    assert torch.equal(barriers[False], expected[1]) and torch.equal(barriers[True], expected[1])
    # the L2 requests are inline PTX, which the interpreter does not run: their variants are compiled only
    asking = [{**launch, "constexprs": {**launch["constexprs"], "ASK_L2": True}} for launch in launches
              if not launch["constexprs"].get("READ_FIRST")]
    assert {launch["kernel"] for launch in asking} == {"bench.boundary._phase_kernel", "bench.boundary._phases_kernel"}
    assert compile_errors(launches + asking) == {}
