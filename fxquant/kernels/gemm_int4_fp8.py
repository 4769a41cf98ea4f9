"""W4A8: out[M, N] = (A[M, K] * a_scale) @ (W[N, K] * w_scale).T (+ bias), with e4m3 activations and int4 weights
multiplied on the fp8 tensor cores.

Each int4 code, less its group's zero point (-15..15), or sign-extended where the scheme has none (-8..7), is an
integer e4m3 holds exactly, so the codes go into the MMA as e4m3 with no rounding. One K step is one weight group
(128): its fp32 partial sum takes the group's scales [N] before it joins the fp32 accumulator, and the per-token
activation scales [M] multiply the tile once at the end, since they are constant along K.

This first kernel is the plain tiled loop, correct at every M; its tiles are not tuned on the GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_fp8, cast_mode
from fxquant.kernels.codes import packed_words, split_words
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, visible

GROUP = 128  # the only weight group this kernel takes: one group per K step
BLOCK_M, BLOCK_N = 16, 64  # tl.dot's smallest M; untuned


def supports(a: torch.Tensor, w: torch.Tensor, group: int, out_dtype: torch.dtype) -> str | None:
    """Why this kernel cannot compute the product, or None where it can."""
    if not a.is_cuda:
        return "it runs on CUDA devices (the CPU takes the reference)"
    if group != GROUP:
        return f"its weight groups are {GROUP} wide, not {group}"
    if a.shape[-1] % GROUP:
        return f"K = {a.shape[-1]} is not a multiple of its group, {GROUP}"
    if out_dtype not in TORCH_TO_TL:
        return f"it writes bf16, fp16 or fp32, not {out_dtype}"
    return None


@triton.jit
def _int4_fp8_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, bias_ptr, out_ptr, M, N, K,
                     stride_am, stride_wn, stride_sn, stride_om,
                     HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, GROUP)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, K // GROUP):
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (g * GROUP + offs_k)[None, :],
                    mask=mask_m[:, None], other=0.0)  # [BM, GROUP] e4m3
        codes = split_words(packed_words(w_ptr, offs_n, mask_n, g, K, stride_wn, GROUP, True))  # [BN, GROUP]
        if HAS_ZP:
            zero = tl.load(w_zero_ptr + offs_n * stride_sn + g, mask=mask_n, other=0).to(tl.int32)
            values = codes - zero[:, None]
        else:
            values = (codes ^ 8) - 8  # two's complement nibbles, sign-extended
        w8 = cast_fp8(values.to(tl.float32), tl.float8e4nv, CAST)  # small integers: exact in e4m3
        scale = tl.load(w_scale_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
        # The group's partial in fp32, scaled, then added: the MMA's short accumulator spans one group only.
        acc += tl.dot(a, tl.trans(w8)) * scale[None, :]
    acc *= tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(OUT), mask=mask_m[:, None] & mask_n[None, :])


def int4_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                zero_point: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """a: [M, K] e4m3 codes with a_scale [M, 1] (per token); w: [N, K/2] packed int4 codes with w_scale [N, K/128]
    fp32 and zero_point [N, K/128] uint8 (or None: symmetric codes). Returns [M, N] in out_dtype."""
    M, K = a.shape
    N = w.shape[0]
    if w.shape != (N, K // 2) or w_scale.shape != (N, K // GROUP):
        raise ValueError(f"fxquant: int4 x fp8 GEMM needs codes [N, K/2] and scales [N, K/{GROUP}] for K = {K}; got "
                         f"{tuple(w.shape)} and {tuple(w_scale.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    words = w.contiguous().reshape(-1).view(torch.int32).reshape(N, -1)  # 8 codes a word, as codes.py reads them
    scale = w_scale.contiguous()
    zero = zero_point.contiguous() if zero_point is not None else scale
    visible(_int4_fp8_kernel)[(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))](
        a.contiguous(), a_scale.reshape(M).contiguous(), words, scale, zero, bias if bias is not None else out, out,
        M, N, K, K, words.stride(0), scale.stride(0), out.stride(0),
        HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None, OUT=TORCH_TO_TL[out_dtype],
        CAST=cast_mode(_int4_fp8_kernel, a.device), GROUP=GROUP, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )
    return out
