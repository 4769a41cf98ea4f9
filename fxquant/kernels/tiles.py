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
def k_steps_of(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """[first, last) BLOCK_K steps of K slice pid_k."""
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    first = pid_k * per_split
    return first, min(k_steps, first + per_split)


@triton.jit
def _store_c(acc, c_ptr, bias_ptr, offs_m, offs_n, mask, N, stride_cm, stride_cn, HAS_BIAS: tl.constexpr,
             OUT: tl.constexpr, CAST: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, cast_float(acc, OUT, CAST), mask=mask)


@triton.jit
def store_tile(acc, c_ptr, ws_ptr, locks_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, tile, pid_k,
               HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr):
    """The fp32 tile, biased and cast once into C. Split along K, each slice stores its fp32 partial and counts
    itself in the tile's lock; the last to arrive adds the SPLIT_K partials in slice order (the same bits whichever
    slice is last), stores C and zeroes the lock for the next GEMM."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        _store_c(acc, c_ptr, bias_ptr, offs_m, offs_n, mask, N, stride_cm, stride_cn, HAS_BIAS, OUT, CAST)
    else:
        partials = ws_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(partials + pid_k * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's part of the partial is written before the slice counts itself
        arrived = tl.atomic_add(locks_ptr + tile, 1, sem="acq_rel", scope="gpu")  # publish ours, see theirs
        if arrived == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for s in range(SPLIT_K):  # .cg: read the other SMs' partials from L2, never a stale L1 line
                total += tl.load(partials + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            _store_c(total, c_ptr, bias_ptr, offs_m, offs_n, mask, N, stride_cm, stride_cn, HAS_BIAS, OUT, CAST)
            tl.atomic_xchg(locks_ptr + tile, 0)
