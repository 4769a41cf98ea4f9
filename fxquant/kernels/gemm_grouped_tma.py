"""The grouped fp8 GEMM fed by TMA: tensor descriptors over the activations [M, K] and the experts' weights stacked
[E * N, K], for many rows an expert on Hopper (docs/decisions/0037-moe-prefill-grouped-fp8-through-tma.md; channel
groups: 0038-w4a8-experts-channel-groups-through-tma.md).

The same tiles, expert lookup (`tiles.expert_tile_offsets`, no host sync) and numerics as `_grouped_fp8_kernel`'s
row-scale path (fp32 accumulation promoted by the compiler every BLOCK_K, row scales in the epilogue) and its channel
groups' (W4A8's codes made e4m3: each 128-wide K step's fp32 partial times the weight's group scales, the token's
scale after the loop). What differs is
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

from fxquant.kernels.gemm_fp8 import channel_scales, fp8_scale_tile
from fxquant.kernels.launch import visible
from fxquant.kernels.tiles import expert_k_steps, expert_tile_offsets, store_tile


@triton.jit
def _grouped_fp8_tma_kernel(
    # descriptors and pointers
    a_desc, b_desc, offs_ptr, c_ptr, a_scale_ptr, b_scale_ptr,
    # sizes
    M, N, K, E,
    # strides
    stride_cm, stride_cn, stride_asm, stride_bse, stride_bsn, stride_bsk,
    # meta-parameters
    CHANNEL_GROUPS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    expert, pid_n, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    owned, e, first_k, last_k = expert_k_steps(expert, E, K, BLOCK_K, 1)
    first_row = tl.min(offs_m, axis=0)  # the tile's first row of its expert; M where it owns none
    weight_row = (e * N + pid_n * BLOCK_N).to(tl.int32)  # a descriptor's coordinates are int32
    b_scale_ptr += e * stride_bse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_k, last_k):
        a = a_desc.load([first_row, k * BLOCK_K])  # [BM, BK]; rows past M and the K tail read as zeros
        b = b_desc.load([weight_row, k * BLOCK_K])  # [BN, BK]
        if CHANNEL_GROUPS:
            # Each group's fp32 partial scaled before it joins the accumulator: the fp8 MMA's own accumulator keeps
            # fewer bits (docs/decisions/0002).
            acc += tl.dot(a, tl.trans(b)) * channel_scales(b_scale_ptr, offs_n, offs_n < N, k, stride_bsn,
                                                           stride_bsk)[None, :]
        else:
            # The compiler adds the MMA's partial into fp32 every BLOCK_K, keeping wgmma asynchronous.
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
    if CHANNEL_GROUPS:  # the token's scale is constant along K
        acc *= tl.load(a_scale_ptr + offs_m * stride_asm, mask=offs_m < M, other=0.0)[:, None]
    else:
        acc = fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, stride_asm, stride_bsn, False)
    acc = tl.where(owned, acc, 0.0)  # a non-finite scale of the clamped expert must not reach the zero rows
    store_tile(acc, c_ptr, c_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, 0, False, 1, OUT, CAST)


def describable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a [M, K] and the experts b [E, N, K] can be read through tensor descriptors: K contiguous, the experts
    one [E * N, K] matrix, row strides and base addresses multiples of 16 bytes (the copy engine's alignment)."""
    E, N, K = b.shape
    stacked = b.stride(0) == N * b.stride(1)
    return stacked and all(t.stride(-1) == 1 and t.stride(-2) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (a, b))


def launch_grouped_tma(a, offs, b, out, a_scale, b_scale, grid, strides, *, channel_groups: bool, out_tl, cast: int,
                       meta: dict) -> None:
    """Run the TMA grouped kernel into `out` [M, N] over `grid` (the pointer kernel's, unsplit). strides: the
    activation scales' row stride, the weight scales' expert, row and group strides."""
    (M, K), (E, N) = a.shape, b.shape[:2]
    bm, bn, bk = meta["BLOCK_M"], meta["BLOCK_N"], meta["BLOCK_K"]
    visible(_grouped_fp8_tma_kernel)[grid[:1]](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b.view(E * N, K), [bn, bk]), offs,
        out, a_scale, b_scale, M, N, K, E, out.stride(0), out.stride(1), *strides,
        CHANNEL_GROUPS=channel_groups, OUT=out_tl, CAST=cast, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=meta["GROUP_M"], num_warps=meta["num_warps"], num_stages=meta["num_stages"],
    )
