"""Kernels that only read: what reading a decode GEMM's weight bytes costs, without the GEMM.

`read_as_int4_programs` reads int4 tiles, lane scales and zero points with the int4 mma.sync kernel's grid and program
plan (one warp over a 64-row tile, one K slice, the same STAGES-deep pipeline): its time is the floor of that access
pattern; or with several adjacent tiles a program, a warp each. `read_then_sum_as_int4_programs` reads the same so and
ends as that kernel ends, storing split-K partials that the last slice sums: its time less the reads' is the split-K
tail's. `read_flat` reads any tensor front to back, 16 KB a program step over a persistent grid: the floor of reading
the same bytes as well as a plain kernel can. Each program sums what it reads into one int32 (wrapping), so that no load
is dead; the sums are not a checksum of anything and serve only the tests, which compare them with torch's over the same
words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import float_cast_mode
from fxquant.kernels.launch import cdiv
from fxquant.kernels.mma_fragments import store_partials
from fxquant.kernels.splitk import counters, sum_if_last_slice

FLAT_WORDS = 4096  # int32 words a program step of read_flat: 16 KB, one contiguous run
FLAT_PROGRAMS_PER_SM = 4


@triton.jit
def _read_as_int4_kernel(w_ptr, s_ptr, z_ptr, out_ptr, K, G, row_tiles, SPLIT_K: tl.constexpr,
                         TILES: tl.constexpr, STAGES: tl.constexpr):
    tile = tl.program_id(0) * TILES + tl.arange(0, TILES)[:, None]  # TILES tiles of 64 rows, one a warp
    live = tile < row_tiles
    steps = K // 128
    per_slice = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(1) * per_slice
    last = tl.minimum(first + per_slice, steps)
    codes = tl.zeros((TILES, 1024), tl.int32)
    scales = tl.zeros((TILES, 64), tl.int32)
    zeros = tl.zeros((TILES, 16), tl.int32)
    for step in tl.range(first, last, num_stages=STAGES):
        at = (tile.to(tl.int64) * steps + step) * 1024 + tl.arange(0, 1024)[None, :]  # the step's tiles
        codes += tl.load(w_ptr + at, mask=live, other=0)
        record = tile * G + step * 128 // (K // G)  # the step's group: its 64 scales and 64 zero points a tile
        scales += tl.load(s_ptr + record * 64 + tl.arange(0, 64)[None, :], mask=live, other=0)
        zeros += tl.load(z_ptr + record * 16 + tl.arange(0, 16)[None, :], mask=live, other=0)
    tl.store(out_ptr + tl.program_id(0) * SPLIT_K + tl.program_id(1), tl.sum(codes) + tl.sum(scales) + tl.sum(zeros))


@triton.jit
def _read_then_sum_kernel(w_ptr, s_ptr, z_ptr, ws_ptr, c_ptr, counter_ptr, N, K, G, SPLIT_K: tl.constexpr,
                          STAGES: tl.constexpr, CAST: tl.constexpr):
    tile = tl.program_id(0)
    steps = K // 128
    per_slice = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(1) * per_slice
    last = tl.minimum(first + per_slice, steps)
    codes = tl.zeros((1024,), tl.int32)
    scales = tl.zeros((64,), tl.int32)
    zeros = tl.zeros((16,), tl.int32)
    for step in tl.range(first, last, num_stages=STAGES):
        codes += tl.load(w_ptr + (tile.to(tl.int64) * steps + step) * 1024 + tl.arange(0, 1024))
        record = tile * G + step * 128 // (K // G)
        scales += tl.load(s_ptr + record * 64 + tl.arange(0, 64))
        zeros += tl.load(z_ptr + record * 16 + tl.arange(0, 16))
    groups = tl.sum(scales) + tl.sum(zeros)
    acc = (tl.sum(tl.reshape(codes, (32, 4, 8)), axis=2) + groups).to(tl.float32)  # a C fragment's shape
    lane = tl.arange(0, 32)
    rows0 = (tile * 64 + lane // 4)[:, None] + tl.arange(0, 4)[None, :] * 16
    store_partials(ws_ptr, N, acc, acc, acc, acc, lane % 4, rows0, rows0 + 8, 1, N)  # as the GEMM, at M = 1
    sum_if_last_slice(ws_ptr, c_ptr, c_ptr, counter_ptr, tile, tl.arange(0, 8), tile * 64 + tl.arange(0, 64), 1, N, N,
                      1, False, SPLIT_K, tl.bfloat16, CAST)


@triton.jit
def _read_flat_kernel(x_ptr, out_ptr, words, WORDS: tl.constexpr, STAGES: tl.constexpr):
    total = tl.zeros((WORDS,), tl.int32)
    offsets = tl.arange(0, WORDS)
    for start in tl.range(tl.program_id(0) * WORDS, words, tl.num_programs(0) * WORDS, num_stages=STAGES):
        where = offsets.to(tl.int64) + start
        total += tl.load(x_ptr + where, mask=where < words, other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(total))


def read_as_int4_programs(tiles: torch.Tensor, lane_scale: torch.Tensor, lane_zero: torch.Tensor, split: int,
                          stages: int = 3, tiles_per_program: int = 1) -> torch.Tensor:
    """Read int4 tiles [N / 64, K / 128, 64, 16] (int32 words), their `pack_lanes` scales [N / 64, G, 8, 4, 2]
    (fp32) and zero points [N / 64, G, 8, 2] (int32) as the int4 mma.sync kernel's (tile, K slice) programs do, K
    cut into `split` slices; a program a warp a tile, or `tiles_per_program` adjacent tiles with a warp each.
    Returns each program's wrapped int32 sum [programs * split]."""
    row_tiles, k_steps = tiles.shape[:2]
    groups = lane_scale.shape[1]
    programs = cdiv(row_tiles, tiles_per_program)
    out = torch.empty(programs * split, dtype=torch.int32, device=tiles.device)
    _read_as_int4_kernel[(programs, split)](tiles, lane_scale.view(torch.int32), lane_zero, out, k_steps * 128,
                                            groups, row_tiles, SPLIT_K=split, TILES=tiles_per_program,
                                            STAGES=stages, num_warps=tiles_per_program, num_stages=stages)
    return out


def read_then_sum_as_int4_programs(tiles: torch.Tensor, lane_scale: torch.Tensor, lane_zero: torch.Tensor, split: int,
                                   stages: int = 3) -> torch.Tensor:
    """Read what `read_as_int4_programs` reads, as it does (a warp a tile and K slice), then end as the int4 mma.sync
    kernel does at M = 1: each program stores its K slice's fp32 partials and the tile's last slice sums them into
    the bf16 output (`splitk.sum_if_last_slice`). The partial for rows 64 tile + g + 16 b and + 8 is the sum of the
    slice's code words 32 (4 g) + 8 b .. + 7 of each step's tile, plus all its scales and zero-point words. Returns
    the output [1, N]."""
    row_tiles, k_steps = tiles.shape[:2]
    n = row_tiles * 64
    ws = torch.empty((split, 1, n), dtype=torch.float32, device=tiles.device)
    out = torch.empty((1, n), dtype=torch.bfloat16, device=tiles.device)
    count = counters(tiles.device, row_tiles)
    if count is None:
        raise RuntimeError("bench.read_floor: no split-K tile counters here (a first call inside a CUDA graph capture)")
    _read_then_sum_kernel[(row_tiles, split)](tiles, lane_scale.view(torch.int32), lane_zero, ws, out, count, n,
                                              k_steps * 128, lane_scale.shape[1], SPLIT_K=split, STAGES=stages,
                                              CAST=float_cast_mode(_read_then_sum_kernel), num_warps=1,
                                              num_stages=stages)
    return out


def read_flat(x: torch.Tensor, programs: int | None = None, stages: int = 3) -> torch.Tensor:
    """Read a contiguous tensor (a whole number of int32 words) front to back, FLAT_WORDS words a program step, over
    `programs` programs (FLAT_PROGRAMS_PER_SM a multiprocessor, fewer where there are fewer steps). Returns each
    program's wrapped int32 sum."""
    words = x.reshape(-1).view(torch.int32)
    if programs is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 2
        programs = FLAT_PROGRAMS_PER_SM * sms
    programs = max(1, min(programs, cdiv(words.numel(), FLAT_WORDS)))
    out = torch.empty(programs, dtype=torch.int32, device=x.device)
    _read_flat_kernel[(programs,)](words, out, words.numel(), WORDS=FLAT_WORDS, STAGES=stages, num_warps=4,
                                   num_stages=stages)
    return out
