"""Weight-only GEMMs past decode's M with the weight dequantized tile by tile: out[M, N] = A[M, K] @ W[N, K].T.

The dequantized route (`gemm_weight_only`'s past DEQUANTIZE_ABOVE_M) writes a bf16 copy of the weight every call
and cuBLAS reads it back: 4 bytes of traffic a weight element on top of the codes. Here each program dequantizes its
[BLOCK_N, BLOCK_K] weight tile in registers to the values `dequantize_weight` writes (the same fp32 operations,
`dequantized_tile`, rounded once to the activations' dtype), so both routes multiply the same operands.

The product is computed transposed, out.T = W @ A.T: on sm_90 wgmma takes its first operand from registers and only
its second from shared memory, so the dequantized weight goes to the tensor cores from the registers that decoded
it, while the pipeline stages A's tiles through shared memory.

Not yet the default: the dequantized route is what was measured (docs/decisions/0006). FXQUANT_WEIGHT_ONLY_PREFILL=tiles
in the environment, or `prefill_in_tiles(True)`, takes this one past DEQUANTIZE_ABOVE_M, so that the two can be timed
side by side (`python -m bench.weight_only --prefill`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, float_cast_mode, interpreting
from fxquant.kernels.codes import FORMATS
from fxquant.kernels.dequantize_weight import dequantized_tile
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, set_inside, visible
from fxquant.kernels.tiles import expert_tile_offsets, tile_offsets

_in_tiles = [os.environ.get("FXQUANT_WEIGHT_ONLY_PREFILL", "dequantize") == "tiles"]


def prefill_in_tiles(enabled: bool):
    """Weight-only products past DEQUANTIZE_ABOVE_M inside the block dequantize tile by tile (True) or write the
    dequantized weight for cuBLAS (False)."""
    return set_inside(_in_tiles, enabled)


def in_tiles() -> bool:
    return _in_tiles[0]


@triton.jit
def _wo_tiles_kernel(
    # pointers (offs: the experts' cumulative int32 row ends, where GROUPED)
    a_ptr, offs_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, c_ptr, bias_ptr,
    # sizes (E: experts, where GROUPED)
    M, N, K, E,
    # strides (the weight's in its own elements: bytes for int8, int32 words of packed codes for 4-bit); the
    # experts' strides of the codes, the scales (and zero points) and NVFP4's global scale
    stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk, stride_cm, stride_cn, stride_we, stride_se,
    stride_ge,
    # meta-parameters
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr,
    DOT: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
):
    k_steps = tl.cdiv(K, BLOCK_K)
    if GROUPED:  # rows sorted by expert, each expert's cut into tiles of its own (tiles.expert_rows)
        expert, _, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N)
        owned = (expert >= 0) & (expert < E)  # the rows past offs[-1] run no K step and come out zero
        expert = tl.minimum(tl.maximum(expert, 0), E - 1).to(tl.int64)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
        z_ptr += expert * stride_se  # zero points share the scales' layout
        gs_ptr += expert * stride_ge
        k_steps = tl.where(owned, k_steps, 0)
    else:  # weight row tiles are the MMA's M: GROUP_N of them take turns over each tile of A while it is in L2
        _, _, offs_n, offs_m = tile_offsets(tl.program_id(0), N, M, BLOCK_N, BLOCK_M, GROUP_N)
    mask_m = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, k_steps):
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        # columns past K are zero in A, since the weight's are not (dequantized_tile)
        a_mask = mask_m[None, :] if EVEN_K else mask_m[None, :] & (k[:, None] < K)
        a_t = tl.load(a_ptr + offs_m[None, :].to(tl.int64) * stride_am + k[:, None] * stride_ak, mask=a_mask,
                      other=0.0)  # [BK, BM]: A.T's tile, the MMA's second operand
        w = dequantized_tile(w_ptr, s_ptr, z_ptr, gs_ptr, offs_n, step, N, K, stride_wn, stride_wk, stride_sn,
                             stride_sk, FMT, GROUP, HAS_ZP, EVEN_K, BLOCK_K)
        # rounded once to the activations' dtype, as dequantize_weight rounds it
        acc = tl.dot(cast_float(w, OUT, CAST).to(DOT), a_t.to(DOT), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + offs_m[None, :].to(tl.int64) * stride_cm + offs_n[:, None] * stride_cn
    tl.store(c_ptrs, cast_float(acc, OUT, CAST), mask=(offs_n < N)[:, None] & mask_m[None, :])

def tiles_config(M: int) -> dict:
    """Tiles of 128 weight rows (two warpgroups of 64, the MMA's M) by 256 activation rows (128 at M <= 128) by 64
    of K: 252 registers a thread without a spill on sm_90 (Triton 3.8), where the accumulator is 128 of them. Not yet
    tuned on a GPU."""
    return dict(BLOCK_N=128, BLOCK_M=256 if M > 128 else 128, BLOCK_K=64, GROUP_N=8, num_warps=8, num_stages=3)


def weight_only_tiles_mm(a, codes, scale, fmt: str, group: int, N: int, zero_point=None, global_scale=None,
                         bias=None, config: dict | None = None, offs=None) -> torch.Tensor:
    """a @ W.T (+ bias) for a: [M, K] bf16/fp16 and the weight's codes and scales as `weight_operands` gives them;
    W is the weight `dequantize_weight` writes, bit for bit, in a's dtype. With `offs` (int32 [E], cumulative row
    ends), the codes, scales and zero points carry a leading dim of E experts (NVFP4's global scale one each, [E]),
    and each expert's rows of a take its weight; rows past offs[-1] come out zero. config: tiles_config's keys."""
    (M, K), grouped = a.shape, offs is not None
    E = codes.shape[0] if grouped else 0
    cfg = config or tiles_config(cdiv(M, min(M, E)) if grouped else M)  # groups and BLOCK_K: powers of two
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    meta = {name: cfg[name] for name in ("BLOCK_N", "BLOCK_M", "BLOCK_K", "GROUP_N", "num_warps", "num_stages")}
    # experts: the worst case of row tiles, each expert's rows cut apart (programs past the last tile only scan)
    row_tiles = cdiv(M, meta["BLOCK_M"]) + (E + 1 if grouped else 0)
    expert_stride = lambda t: t.stride(0) if grouped and t is not None else 0
    visible(_wo_tiles_kernel)[(row_tiles * cdiv(N, meta["BLOCK_N"]),)](
        a, offs if grouped else a, codes, scale, zero_point if zero_point is not None else scale,
        global_scale if global_scale is not None else scale, out, bias if bias is not None else out,
        M, N, K, E,
        a.stride(0), a.stride(1), codes.stride(-2), codes.stride(-1), scale.stride(-2), scale.stride(-1),
        out.stride(0), out.stride(1), expert_stride(codes), expert_stride(scale), expert_stride(global_scale),
        FMT=FORMATS[fmt], GROUP=group or 1, HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None,
        GROUPED=grouped, DOT=tl.float32 if interpreting(_wo_tiles_kernel) else TORCH_TO_TL[a.dtype],
        OUT=TORCH_TO_TL[a.dtype], CAST=float_cast_mode(_wo_tiles_kernel), EVEN_K=K % meta["BLOCK_K"] == 0, **meta,
    )
    return out
