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
