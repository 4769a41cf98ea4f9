"""bench.read_floor's kernels read every word they are given once (their sums equal torch's over the same words) and
compile for sm_90; bench.int4_chain lays a random int4 weight's operands out as one run."""

import pytest
import torch

from bench.int4_chain import GROUP, gemm_words, random_int4_gemm
from bench.read_floor import FLAT_WORDS, read_as_int4_programs, read_flat, read_then_sum_as_int4_programs
from tests.sm90_compile import compile_errors, recorded_launches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launches are the ones recorded")


def _words(n: int, generator: torch.Generator) -> torch.Tensor:
    """Small int32 words, so that no sum wraps and each word read twice or left out changes the total."""
    return torch.randint(1, 1000, (n,), dtype=torch.int32, generator=generator)


def test_the_reads_sum_each_word_once_and_compile_for_sm90():
    generator = torch.Generator().manual_seed(0)
    n, k, split = 128, 512, 3  # 4 K steps over 3 slices: the last slice is short
    tiles = _words(n * k // 8, generator).view(n // 64, k // 128, 64, 16)
    scale = _words(n // 64 * k // GROUP * 64, generator).view(torch.float32).view(n // 64, k // GROUP, 8, 4, 2)
    zero = _words(n // 64 * k // GROUP * 16, generator).view(n // 64, k // GROUP, 8, 2)
    flat = _words(2 * FLAT_WORDS + 5, generator)  # two whole steps and a part-filled third
    with recorded_launches() as launches:
        by_program = read_as_int4_programs(tiles, scale, zero, split)
        by_programs_of_tiles = read_as_int4_programs(tiles, scale, zero, split, tiles_per_program=4)  # 2 tiles
        by_flat = read_flat(flat, programs=2)
        summed = read_then_sum_as_int4_programs(tiles, scale, zero, split)
    assert by_program.shape == (n // 64 * split,)
    assert by_program.sum() == tiles.sum() + scale.view(torch.int32).sum() + zero.sum()
    assert by_programs_of_tiles.shape == (split,) and by_programs_of_tiles.sum() == by_program.sum()
    assert by_flat.shape == (2,) and by_flat.sum() == flat.sum()
    # each tile's output rows g + 16 b and g + 8 + 16 b: its words 32 (4 g) + 8 b .. + 7 of every step, plus every
    # scale and zero-point word of its groups, summed over the K slices (integers under 2^24: exact in fp32)
    words = tiles.reshape(n // 64, k // 128, 32, 4, 8)[:, :, 0::4].sum(dim=(1, 4))  # [tiles, g, b]
    groups = scale.view(torch.int32).flatten(1).sum(1) + zero.flatten(1).sum(1)
    expected = (words + groups[:, None, None]).transpose(1, 2).reshape(n // 64, 4, 1, 8).expand(-1, -1, 2, -1)
    assert torch.equal(summed, expected.reshape(1, n).float().to(torch.bfloat16))
    assert compile_errors(launches) == {}


def test_a_random_int4_weight_is_one_run_of_tiles_scales_and_zero_points():
    n, k = 128, 256
    words = torch.zeros(gemm_words(n, k) + 7, dtype=torch.int32)
    tiles, scale, zero, run = random_int4_gemm(words, n, k)
    assert run.numel() == gemm_words(n, k) and (words[run.numel():] == 0).all()
    assert tiles.shape == (2, 2, 64, 16) and scale.shape == (2, 2, 8, 4, 2) and zero.shape == (2, 2, 8, 2)
    assert tiles.data_ptr() == words.data_ptr() and run.numel() == tiles.numel() + scale.numel() + zero.numel()
    assert scale.dtype == torch.float32 and bool(((scale >= 1e-3) & (scale <= 2e-3)).all())
    assert int(zero.view(torch.uint8).max()) < 16
