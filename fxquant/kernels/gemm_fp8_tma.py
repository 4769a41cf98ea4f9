"""FP8 scaled GEMM for large M on Hopper: TMA tensor descriptors, a persistent grid, software pipelining.

The same product and numerics as `gemm_fp8.py`: fp32 accumulation, row scales applied in the epilogue, block
scales folded into the accumulator at every 128-wide K step. What differs is how tiles are fed:
- A [M, K] and B [N, K] are read through host-built tensor descriptors, so the copy engine moves whole tiles into
  shared memory (and zero-fills M/N/K tails) while the warps only issue MMAs;
- one program per SM walks the output tiles in grouped order, and the tile loop and the K loop are flattened into
  one pipelined loop, so the next tile's loads start during the current tile's epilogue.
`gemm_fp8.fp8_scaled_mm` launches it when a configuration asks for it (`TMA`) and the operands suit descriptors
(`describable`): rows contiguous along K, 16-byte aligned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fxquant.kernels.launch import cdiv, visible
from fxquant.kernels.tiles import store_tile, tile_offsets


@triton.jit
def _fp8_gemm_tma_kernel(
    # descriptors and pointers
    a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr,
    # sizes
    M, N, K,
    # strides
    stride_cm, stride_cn, stride_asm, stride_ask, stride_bsn, stride_bsk,
    # the grid's size: each program takes every programs-th tile
    programs,
    # meta-parameters
    BLOCK_SCALES: tl.constexpr, SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
    CAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), tiles, programs, flatten=True):
        pid_m, pid_n, offs_m, offs_n = tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_steps):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])  # [BM, BK]; tails read as zeros
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])  # [BN, BK]
            if BLOCK_SCALES:
                # BLOCK_K == SCALE_BLOCK >= BLOCK_N: one activation scale per row, one weight scale per tile.
                a_s = tl.load(a_scale_ptr + offs_m * stride_asm + k * stride_ask, mask=offs_m < M, other=0.0)
                b_s = tl.load(b_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn + k * stride_bsk)
                acc += tl.dot(a, tl.trans(b)) * (a_s[:, None] * b_s)
            else:
                # The compiler adds the MMA's partial into fp32 every BLOCK_K, keeping wgmma asynchronous.
                acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
        if not BLOCK_SCALES:
            a_s = tl.load(a_scale_ptr + offs_m * stride_asm, mask=offs_m < M, other=0.0)
            b_s = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=offs_n < N, other=0.0)
            acc = acc * a_s[:, None] * b_s[None, :]
        store_tile(acc, c_ptr, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, 0,
                   HAS_BIAS, 1, OUT, CAST)


def describable(*operands: torch.Tensor) -> bool:
    """Whether the operands (A [M, K], B [N, K]) can be read through tensor descriptors: rows contiguous along K, and
    row strides and base addresses multiples of 16 bytes (the copy engine's alignment)."""
    return all(t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0 for t in operands)


def launch_tma(a, b, out, a_scale, b_scale, bias, strides, *, block_scales: bool, scale_block: int, out_tl,
               cast: int, cfg: dict, sms: int) -> None:
    """Run the persistent TMA kernel into `out` with the tile configuration `cfg` on a GPU with `sms` SMs.
    strides: out's, then the activation and weight scales' (row, K)."""
    (M, K), N = a.shape, b.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    programs = min(cdiv(M, bm) * cdiv(N, bn), sms)
    visible(_fp8_gemm_tma_kernel)[(programs,)](
        TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]), out, a_scale, b_scale,
        bias if bias is not None else out,
        M, N, K,
        *strides, programs,
        BLOCK_SCALES=block_scales, SCALE_BLOCK=scale_block, HAS_BIAS=bias is not None, OUT=out_tl, CAST=cast,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
