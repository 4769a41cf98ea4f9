"""Weight-only codes to a bf16/fp16 weight on the GPU, bit-exact with `reference.dequantize(q, dtype)`.

The weight-only GEMM uses it above decode and medium M, where dequantizing the weight once per call and running
cuBLAS costs one pass over the codes plus a bf16 write, while dequantizing in registers repeats the work for every
row tile and holds the tensor cores back. The values are computed in fp32 in the reference's order and rounded
once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, float_cast_mode
from fxquant.kernels.code_tiles import TILE_ROWS, is_tiled
from fxquant.kernels.codes import FORMATS, TWO_POW_23, biased, block_scale, e2m1_value, mxfp8_values, nibbles
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, visible


@triton.jit
def _dequantize_kernel(
    # pointers
    w_ptr, s_ptr, z_ptr, gs_ptr, out_ptr,
    # sizes and strides (the codes' in their own elements: bytes for int8, int32 words for 4-bit); the experts'
    # (program_id 2) where the weights are stacked, 0 for one weight
    N, K, stride_wn, stride_wk, stride_sn, stride_sk, stride_on, stride_we, stride_se, stride_ge, stride_oe,
    # meta-parameters
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr,
):
    pid_k = tl.program_id(1)
    expert = tl.program_id(2).to(tl.int64)
    w_ptr += expert * stride_we
    s_ptr += expert * stride_se
    z_ptr += expert * stride_se  # zero points share the scales' layout
    gs_ptr += expert * stride_ge
    out_ptr += expert * stride_oe
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    BLOCKS: tl.constexpr = BLOCK_K // GROUP  # scale blocks per tile (BLOCK_K is a multiple of every group)
    offs_b = pid_k * BLOCKS + tl.arange(0, BLOCKS)
    mask_b = mask_n[:, None] & (offs_b[None, :] * GROUP < K)
    if FMT == 0 or FMT == 4:  # a byte per code
        codes = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                        mask=mask_n[:, None] & (k[None, :] < K), other=0)
        if FMT == 0:  # code times its channel's scale
            values = codes.to(tl.float32) * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[:, None]
        else:  # e4m3 value times its block's E8M0 scale
            values = mxfp8_values(codes, block_scale(s_ptr, offs_n[:, None], offs_b[None, :], stride_sn, stride_sk,
                                                     mask_b, FMT), GROUP)
    else:
        codes = nibbles(w_ptr, offs_n, mask_n, pid_k, K, stride_wn, BLOCK_K, EVEN_K, TILED)
        if FMT == 1:  # (q - z) * s: the difference of two biased integers is exact
            scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_b[None, :] * stride_sk, mask=mask_b, other=0.0)
            if HAS_ZP:
                z = tl.load(z_ptr + offs_n[:, None] * stride_sn + offs_b[None, :] * stride_sk, mask=mask_b, other=0)
                zero = biased(z.to(tl.int32))
            else:  # a symmetric code c is (c ^ 8) - 8
                zero = tl.full((BLOCK_N, BLOCKS), TWO_POW_23 + 8.0, tl.float32)
                codes = codes ^ 8
            ints = tl.reshape(biased(codes), (BLOCK_N, BLOCKS, GROUP)) - zero[:, :, None]
            values = ints * scale[:, :, None]
        else:  # the e2m1 value times the block scale (NVFP4: the block scale times the global one, as the reference)
            scale = block_scale(s_ptr, offs_n[:, None], offs_b[None, :], stride_sn, stride_sk, mask_b, FMT)
            if FMT == 3:
                scale = scale * tl.load(gs_ptr)
            values = tl.reshape(e2m1_value(codes), (BLOCK_N, BLOCKS, GROUP)) * scale[:, :, None]
        values = tl.reshape(values, (BLOCK_N, BLOCK_K))
    out_mask = mask_n[:, None] & (k[None, :] < K)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + k[None, :], cast_float(values, OUT, CAST),
             mask=out_mask)


def dequantize_weight(codes, scale, fmt: str, group: int, K: int, dtype: torch.dtype, *, zero_point=None,
                      global_scale=None) -> torch.Tensor:
    """codes: [N, K] int8 or e4m3 (as uint8), or [N, K/8] int32 words of packed 4-bit codes, or packed 4-bit codes
    as `code_tiles`' tiles in int32 words [N / 64, K / 128, 64, 16]; scale: [N, K/group] (E8M0/e4m3 as uint8), [N, 1]
    for int8; or all of them with a leading dim of E stacked experts (NVFP4's global scale then one per expert,
    [E]), one launch for all. Returns the [..., N, K] weight in `dtype`, rounded once."""
    tiled = is_tiled(codes)
    lead, N = ((), codes.shape[0] * TILE_ROWS) if tiled else (tuple(codes.shape[:-2]), codes.shape[-2])
    out = torch.empty((*lead, N, K), dtype=dtype, device=codes.device)
    experts = lead[0] if lead else 1
    if N == 0 or K == 0 or experts == 0:
        return out
    expert_stride = lambda t: t.stride(0) if t is not None and lead else 0
    zero = zero_point if zero_point is not None else scale
    glob = global_scale if global_scale is not None else scale
    block_n, block_k = 32, max(128, group)  # a multiple of every group (power-of-two groups)
    visible(_dequantize_kernel)[(cdiv(N, block_n), cdiv(K, block_k), experts)](
        codes, scale, zero, glob, out,
        N, K, codes.stride(-2), codes.stride(-1), scale.stride(-2), scale.stride(-1), out.stride(-2),
        expert_stride(codes), expert_stride(scale), expert_stride(global_scale), expert_stride(out),
        FMT=FORMATS[fmt], GROUP=group or 1, HAS_ZP=zero_point is not None, OUT=TORCH_TO_TL[dtype],
        CAST=float_cast_mode(_dequantize_kernel), EVEN_K=K % block_k == 0, BLOCK_N=block_n, BLOCK_K=block_k,
        TILED=tiled, num_warps=4,
    )
    return out
