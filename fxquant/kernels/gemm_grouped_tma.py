"""The grouped fp8 GEMM with row scales fed by TMA: tensor descriptors over the activations [M, K] and the experts'
weights stacked [E * N, K], for many rows an expert on Hopper
(docs/decisions/0037-moe-prefill-grouped-fp8-through-tma.md).

The same tiles, expert lookup (`tiles.expert_tile_offsets`, no host sync) and numerics as `_grouped_fp8_kernel`'s
row-scale path: fp32 accumulation promoted by the compiler every BLOCK_K, row scales in the epilogue. What differs is
how a tile is fed: the copy engine moves the tile's BLOCK_M rows from its expert's first row, and BLOCK_N rows of its
expert's weight, while the warps only issue MMAs. Rows past the expert's last (the next expert's, or zeros past M) and
weight rows past N (the next expert's) are multiplied and never stored: every store is masked to the expert's rows
and N. The K loop is not split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fxquant.kernels.gemm_fp8 import fp8_scale_tile
from fxquant.kernels.launch import visible
from fxquant.kernels.tiles import expert_k_steps, expert_tile_offsets, store_tile


@triton.jit
def _grouped_fp8_tma_kernel(
    # descriptors and pointers
    a_desc, b_desc, offs_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    # sizes
    M, N, K, E,
    # strides
    stride_cm, stride_cn, stride_asm, stride_bse, stride_bsn,
    # meta-parameters
    OUT: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    expert, pid_n, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    owned, e, first_k, last_k = expert_k_steps(expert, E, K, BLOCK_K, 1)
    first_row = tl.min(offs_m, axis=0)  # the tile's first row of its expert; M where it owns none
    weight_row = (e * N + pid_n * BLOCK_N).to(tl.int32)  # a descriptor's coordinates are int32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_k, last_k):
        a = a_desc.load([first_row, k * BLOCK_K])  # [BM, BK]; rows past M and the K tail read as zeros
        b = b_desc.load([weight_row, k * BLOCK_K])  # [BN, BK]
        # The compiler adds the MMA's partial into fp32 every BLOCK_K, keeping wgmma asynchronous.
        acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
    acc = fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr + e * stride_bse, offs_m, offs_n, M, N,
                         stride_asm, stride_bsn, False)
    acc = tl.where(owned, acc, 0.0)  # a non-finite scale of the clamped expert must not reach the zero rows
    store_tile(acc, c_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, 0, False, 1, OUT, CAST)


def describable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a [M, K] and the experts b [E, N, K] can be read through tensor descriptors: K contiguous, the experts
    one [E * N, K] matrix, row strides and base addresses multiples of 16 bytes (the copy engine's alignment)."""
    E, N, K = b.shape
    stacked = b.stride(0) == N * b.stride(1)
    return stacked and all(t.stride(-1) == 1 and t.stride(-2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))


def launch_grouped_tma(a, offs, b, out, a_scale, b_scale, grid, strides, *, out_tl, cast: int, meta: dict) -> None:
    """Run the TMA grouped kernel into `out` [M, N] over `grid` (the pointer kernel's, unsplit). strides: the
    activation scales' row stride, the weight scales' expert and row strides."""
    (M, K), (E, N) = a.shape, b.shape[:2]
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    visible(_grouped_fp8_tma_kernel)[grid[:1]](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b.view(E * N, K), [bn, bk]), offs,
        out, a_scale, b_scale, M, N, K, E, out.stride(0), out.stride(1), *strides,
        OUT=out_tl, CAST=cast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=meta["GROUP_M"],
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )
