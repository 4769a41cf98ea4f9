"""Fused RMSNorm / LayerNorm -> dynamic fp8 (per token or 1 x g), with an optional residual add first.

One program per row: load x (and the residual), write the sum back in the model's dtype, reduce the
statistics in fp32, normalize, round the norm's output to the model's dtype where the unfused graph has it,
then quantize it in registers. Matches `fxquant.numerics.reference_norm` bit for bit given the same (mean, rstd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fxquant.kernels.cast import cast_float, cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import next_power_of_2, visible
from fxquant.kernels.quant_fp8 import quant_rows
from fxquant.numerics.formats import AMAX_FLOOR, E4M3

MAX_NORM_DIM = 16384  # one row lives in registers; longer rows run the reference
E4M3_MAX = E4M3.max  # a property computed on each read: read once


@triton.jit
def _add_unfused(a, b, CAST: tl.constexpr):
    """a + b, never contracted with the multiply that made `a` into one FMA: the GPU compiler would round once
    where torch's separate multiply and add round twice. The interpreter never contracts."""
    if CAST == 2:
        return a + b
    return libdevice.add_rn(a, b)


@triton.jit
def _norm_quant_fp8_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, scale_ptr, h_ptr, stats_ptr,
    # sizes
    D, n_groups, eps,
    # meta-parameters
    RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, LP: tl.constexpr,
    GROUP: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    h = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        # The add in fp32, rounded once to the model's dtype: the residual stream the graph keeps.
        h = cast_float(h + tl.load(res_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32), LP, CAST)
        tl.store(h_ptr + row * D + cols, h, mask=mask)
        h = h.to(tl.float32)
    if RMS:
        mean = 0.0
        centered = h
    else:
        mean = tl.math.div_rn(tl.sum(h, 0), D.to(tl.float32))
        centered = tl.where(mask, h - mean, 0.0)
    var = tl.math.div_rn(tl.sum(centered * centered, 0), D.to(tl.float32))
    # IEEE sqrt and division, as the reference: the approximate rsqrt would differ by an ulp.
    rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(var + eps))
    n = centered * rstd
    if HAS_W:
        n = n * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        n = _add_unfused(n, tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32), CAST)
    y = cast_float(n, LP, CAST).to(tl.float32)  # the norm's output in the model's dtype, as quantize sees it
    codes, scale = quant_rows(tl.reshape(y, (BLOCK_D // GROUP, GROUP)), FMAX, FP8, CAST, AMAX_FLOOR)
    tl.store(y_ptr + row * D + cols, tl.reshape(codes, (BLOCK_D,)), mask=mask)
    groups = tl.arange(0, BLOCK_D // GROUP)
    tl.store(scale_ptr + row * n_groups + groups, scale, mask=groups < n_groups)
    tl.store(stats_ptr + row * 2, mean)
    tl.store(stats_ptr + row * 2 + 1, rstd)


def supports(D: int, group_size: int) -> str | None:
    """Why the kernel does not take rows of D with this group (0: per token), or None where it does."""
    if D > MAX_NORM_DIM:
        return f"rows of {D}: one row lives in registers, up to {MAX_NORM_DIM}"
    if group_size & (group_size - 1) or D % (group_size or D or 1):
        return f"group {group_size} over rows of {D}: the kernel takes a power of two dividing the row"
    return None


def norm_quant_fp8(x, weight=None, bias=None, eps=1e-6, group_size=0, *, rms=True, residual=None):
    """x [..., D] (bf16/fp16/fp32) -> (codes [..., D] e4m3, scales [..., D/g or 1] fp32, h, stats [..., 2]).

    h = x + residual in x's dtype (None without a residual); stats = (mean, rstd) fp32 per row.
    """
    D = x.shape[-1]
    group = group_size or D
    if supports(D, group_size) is not None:
        raise ValueError(f"fxquant: fused norm -> fp8 needs D <= {MAX_NORM_DIM} divisible by a power-of-two "
                         f"group (or per token), got D={D}, group {group_size}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"fxquant: residual {tuple(residual.shape)} {residual.dtype} must match x "
                         f"{tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    rows = x.numel() // D if D else 0
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((*x.shape[:-1], D // group), dtype=torch.float32, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    stats = torch.empty((*x.shape[:-1], 2), dtype=torch.float32, device=x.device)
    block = next_power_of_2(D)
    if rows:
        # A power-of-two group divides the padded row: its tail forms whole groups (of zeros), never part of one.
        visible(_norm_quant_fp8_kernel)[(rows,)](
            x, residual if residual is not None else x, weight if weight is not None else x,
            bias if bias is not None else x, codes, scales, h if h is not None else x, stats,
            D, D // group, eps,
            RMS=rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
            LP=TORCH_TO_TL[x.dtype], GROUP=group_size or block, FMAX=E4M3_MAX, FP8=tl.float8e4nv,
            CAST=cast_mode(_norm_quant_fp8_kernel, x.device), AMAX_FLOOR=AMAX_FLOOR, BLOCK_D=block,
            num_warps=min(16, max(1, block // 512)), **launch_options(x.device),
        )
    return codes, scales, h, stats
