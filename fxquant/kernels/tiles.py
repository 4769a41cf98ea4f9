"""In-kernel helpers the GEMMs share: which output tile a program owns, which K steps it runs, how it stores."""

from __future__ import annotations

import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) in grouped order: GROUP_M row-tiles share each column-tile of B while it is hot in L2."""
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    return pid_m, pid_n


@triton.jit
def tile_offsets(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n, rows, columns) of output tile `pid`, taken in grouped order."""
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return pid_m, pid_n, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def k_steps_of(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[first, last) BLOCK_K steps of K slice pid_k."""
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    first = pid_k * per_split
    return first, min(k_steps, first + per_split)


@triton.jit
def store_tile(acc, c_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, pid_k,
               HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr):
    """The fp32 tile: biased and cast once into C, or, split along K, stored as this slice's fp32 partial
    (splitk's reduce adds the slices and the bias, and casts)."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, cast_float(acc, OUT, CAST), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def expert_rows(offs_ptr, num_experts, M, tile_m, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of row tile `tile_m` when rows are sorted by expert, expert e's rows ending at
    offs[e] (cumulative, the grouped_mm contract), and each expert's rows are cut into BLOCK_M tiles of their own.
    The rows past offs[-1], which no expert owns, come last as expert `num_experts`; a tile past all of them is
    expert -1, with first row == end row. A scan over the experts' ends, with no host sync: a CUDA graph replays it."""
    start = tl.full((), 0, tl.int32)
    tiles_before = tl.full((), 0, tl.int32)
    expert = tl.full((), -1, tl.int32)
    first = tl.full((), 0, tl.int32)
    end_row = tl.full((), 0, tl.int32)
    for e in range(0, num_experts + 1):
        end = tl.load(offs_ptr + min(e, num_experts - 1)).to(tl.int32)
        end = tl.where(e < num_experts, end, M)
        count = tl.cdiv(end - start, BLOCK_M)
        hit = (tile_m >= tiles_before) & (tile_m < tiles_before + count)
        expert = tl.where(hit, e, expert)
        first = tl.where(hit, start + (tile_m - tiles_before) * BLOCK_M, first)
        end_row = tl.where(hit, end, end_row)
        tiles_before += count
        start = end
    return expert, first, end_row


@triton.jit
def expert_tile_offsets(offs_ptr, num_experts, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """(expert, pid_n, rows, columns) of program 0-axis id's output tile over rows sorted by expert: rows outside
    the tile's expert are M, which every row mask drops. The grid's row tiles (its 0 axis over the column tiles)
    are taken in grouped order, as the dense GEMMs take theirs: GROUP_M row tiles, most of one expert's, share each
    column tile of its weight while it is hot in L2
    (docs/decisions/0036-moe-prefill-grouped-gemm-order-and-routes.md)."""
    num_n = tl.cdiv(N, BLOCK_N)
    grid_rows = tl.num_programs(0) // num_n * BLOCK_M
    tile_m, pid_n = grouped_tile(tl.program_id(0), grid_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
    expert, first, end = expert_rows(offs_ptr, num_experts, M, tile_m, BLOCK_M)
    rows = first + tl.arange(0, BLOCK_M)
    return expert, pid_n, tl.where(rows < end, rows, M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def expert_k_steps(expert, E, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """(owned, clamped expert, K steps) of a grouped GEMM's tile and K slice: tiles of the ownerless tail rows run no
    K step and store zeros."""
    first_k, last_k = k_steps_of(tl.program_id(1), K, BLOCK_K, SPLIT_K)
    owned = (expert >= 0) & (expert < E)
    return owned, tl.minimum(tl.maximum(expert, 0), E - 1).to(tl.int64), first_k, tl.where(owned, last_k, first_k)
