"""Grouped GEMMs for mixture-of-experts layers: rows sorted by expert, expert e's rows ending at offs[e]
(cumulative int32 ends, the `torch._grouped_mm` contract), out[r] = A[r] @ W[e].T for each of them.

Each expert's rows are cut into row tiles of their own, so a tile never mixes experts; a program finds its tile's
expert by scanning `offs` on the device (`tiles.expert_rows`), with no host sync, so a CUDA graph replays the launch
whatever the routing. The grid covers the worst case, cdiv(M, BLOCK_M) + E + 1 row tiles, and programs past the
last tile only scan. Rows past offs[-1] belong to no expert and come out zero; an expert with no rows has no tile.

The K loops are the dense kernels' (`fp8_accumulate`, `wo_accumulate`, `int4_fp8_accumulate`), on the expert's slice of
the weight and its scales: fp8 with row or 1x128 / 128x128 block scales, fp32 accumulation, scales folded in the K loop;
weight-only int8, int4, MXFP4, NVFP4 and MXFP8 codes decoded in registers; W4A8, int4 codes as fp16 integers beside the
widened e4m3 activations, each group's partial scaled. Tiles are the dense tables' at the average rows per active
expert; where the active tiles are too few for the SMs, K is split (`splitk.py`). Past DEQUANTIZE_ABOVE_M rows per
active expert, weight-only experts are dequantized to bf16 and multiplied by `torch._grouped_mm`, as the dense
weight-only product hands such rows to cuBLAS, and W4A8 experts take the dense W4A8 product expert by expert (cuBLAS's
block-scaled GEMM, decision 0017), the offsets read on the host once, past BY_EXPERT_ABOVE_M rows an expert; from 128
rows up to it, and in a CUDA graph, which cannot read them, every expert's codes are made e4m3 integers and the
grouped fp8 kernel multiplies them with the group scales folded in each K step. Row tiles are taken in grouped order
(GROUP_M at a time), as the dense GEMMs take theirs; past 128 rows an expert, row-scaled fp8 tiles and W4A8's channel
groups are fed by TMA (`gemm_grouped_tma`, decisions 0037 and 0038). The weight-only crossover is the dense one's, not
swept for experts."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability, cast_mode, float_cast_mode, interpreting
from fxquant.kernels.codes import FORMATS, PACKED
from fxquant.kernels.cutlass_grouped import cutlass_grouped_fp8
from fxquant.kernels.cutlass_grouped import supports as cutlass_supports
from fxquant.kernels.dequantize_weight import dequantize_weight
from fxquant.kernels.gemm_configs import fp8_gemm_config
from fxquant.kernels.gemm_fp8 import SCALE_BLOCK, TORCH_TO_TL, fp8_accumulate, fp8_scale_tile
from fxquant.kernels.gemm_grouped_tma import describable as tma_describable
from fxquant.kernels.gemm_grouped_tma import launch_grouped_tma
from fxquant.kernels.gemm_int4_fp8 import (
    CUBLAS_ABOVE_M,
    as_words,
    dot_type,
    int4_as_e4m3,
    int4_fp8_accumulate,
    int4_fp8_config,
    int4_fp8_mm,
)
from fxquant.kernels.gemm_int4_fp8 import GROUP as INT4_GROUP
from fxquant.kernels.gemm_weight_only import (
    CHUNK_ELEMENTS,
    DEQUANTIZE_ABOVE_M,
    weight_operands,
    wo_accumulate,
    wo_gemm_config,
    wo_scale_tile,
)
from fxquant.kernels.launch import cdiv, inlined, visible
from fxquant.kernels.splitk import reduce_partials, split_k
from fxquant.kernels.tiles import expert_k_steps, expert_tile_offsets, store_tile
from fxquant.kernels.unowned_rows import zero_unowned_rows


@triton.jit
def _grouped_fp8_kernel(
    # pointers
    a_ptr, offs_ptr, b_ptr, c_ptr, ws_ptr, a_scale_ptr, b_scale_ptr,
    # sizes
    M, N, K, E,
    # strides
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk,
    # meta-parameters
    BLOCK_SCALES: tl.constexpr, CHANNEL_GROUPS: tl.constexpr, SCALE_BLOCK: tl.constexpr, OUT: tl.constexpr,
    CAST: tl.constexpr, SPLIT_K: tl.constexpr, COMPILER_PROMOTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    expert, pid_n, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    owned, e, first_k, last_k = expert_k_steps(expert, E, K, BLOCK_K, SPLIT_K)
    b_ptr += e * stride_be
    b_scale_ptr += e * stride_bse
    acc = fp8_accumulate(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, offs_m, offs_n, pid_n, M, N, K, first_k, last_k,
                         stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn, stride_bsk,
                         BLOCK_SCALES, SCALE_BLOCK, COMPILER_PROMOTES, BLOCK_M, BLOCK_N, BLOCK_K, CHANNEL_GROUPS,
                         b_ptr, False)
    acc = fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, stride_asm, stride_bsn, BLOCK_SCALES)
    acc = tl.where(owned, acc, 0.0)  # a non-finite scale of the clamped expert must not reach the zero rows
    store_tile(acc, c_ptr, ws_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, tl.program_id(1),
               False, SPLIT_K, OUT, CAST)


@triton.jit
def _grouped_wo_kernel(
    # pointers
    a_ptr, offs_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, c_ptr, ws_ptr,
    # sizes
    M, N, K, E,
    # strides (the weight's in its own elements: bytes, or int32 words of packed 4-bit codes); zero points share
    # the scales' layout
    stride_am, stride_ak, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_cm, stride_cn,
    # meta-parameters
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PAIR_ORDER: tl.constexpr,
):
    expert, pid_n, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    owned, e, first_k, last_k = expert_k_steps(expert, E, K, BLOCK_K, SPLIT_K)
    w_ptr += e * stride_we
    s_ptr += e * stride_se
    z_ptr += e * stride_se
    gs_ptr += e
    acc = wo_accumulate(a_ptr, w_ptr, s_ptr, z_ptr, offs_m, offs_n, M, N, K, first_k, last_k,
                        stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk,
                        FMT, GROUP, HAS_ZP, DOT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PAIR_ORDER)
    acc = wo_scale_tile(acc, s_ptr, gs_ptr, offs_n, N, stride_sn, FMT, DOT)
    acc = tl.where(owned, acc, 0.0)  # a non-finite scale of the clamped expert must not reach the zero rows
    store_tile(acc, c_ptr, ws_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, tl.program_id(1),
               False, SPLIT_K, OUT, CAST)


@triton.jit
def _grouped_int4_fp8_kernel(
    # pointers
    a_ptr, a_scale_ptr, offs_ptr, w_ptr, w_scale_ptr, w_zero_ptr, c_ptr, ws_ptr,
    # sizes
    M, N, K, E,
    # strides (in int32 words: four activation codes, eight weight codes; zero points share the scales' layout)
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    # meta-parameters
    HAS_ZP: tl.constexpr, SPLIT_K: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, GROUP: tl.constexpr,
    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    PAIR_ORDER: tl.constexpr,
):
    expert, pid_n, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    owned, e, first, last = expert_k_steps(expert, E, K, GROUP, SPLIT_K)
    w_ptr += e * stride_we
    w_scale_ptr += e * stride_se
    w_zero_ptr += e * stride_se
    acc = int4_fp8_accumulate(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, offs_m, offs_n, M, N, K, first,
                              last, stride_am, stride_wn, stride_sn, HAS_ZP, DOT, GROUP, BLOCK_M, BLOCK_N, PAIR_ORDER,
                              False)  # experts' codes are rows
    acc = tl.where(owned, acc, 0.0)  # a non-finite scale of the clamped expert must not reach the zero rows
    store_tile(acc, c_ptr, ws_ptr, c_ptr, offs_m, offs_n, M, N, stride_cm, 1, tl.program_id(1),
               False, SPLIT_K, OUT, CAST)


def _grid_and_split(M: int, N: int, K: int, E: int, cfg: dict) -> tuple[tuple[int, int], int]:
    """The launch grid (worst-case row tiles x column tiles, K slices) and its K split. The split aims the tiles
    that hold rows, about min(M, E) experts' worth, at the config's program target."""
    per_expert = cdiv(M, min(M, E))
    active = min(M, E) * cdiv(per_expert, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    split = split_k(active, cdiv(K, cfg["BLOCK_K"]), cfg["programs"]) if cfg.get("programs") else 1
    return ((cdiv(M, cfg["BLOCK_M"]) + E + 1) * cdiv(N, cfg["BLOCK_N"]), split), split


def _check_offs(offs: torch.Tensor, E: int):
    if offs.dtype != torch.int32 or offs.shape != (E,):
        raise ValueError(f"fxquant: grouped GEMM offsets must be int32 [E={E}] cumulative row ends, got "
                         f"{offs.dtype} {tuple(offs.shape)}")


def _finish(ws, out, split, out_dtype):
    if split > 1:
        reduce_partials(ws, out, None, TORCH_TO_TL[out_dtype])
    return out


@functools.lru_cache(maxsize=1024)
def _fp8_plan(M: int, N: int, K: int, E: int, block_scales: bool, channel_groups: bool, overrides: tuple):
    per_expert = cdiv(M, min(M, E))
    cfg = fp8_gemm_config(per_expert, N, K, block_scales, tma=False)
    if per_expert > 128 and not block_scales:
        # Row scales past 128 rows an expert: tiles fed through tensor descriptors (`gemm_grouped_tma`) on 8 warps,
        # 256x128 at 3 stages past 512 rows an expert, else 128x128 at 4. On Mixtral's experts (H100, `python -m
        # bench.grouped_tiles` at bde47e0) gate/up and down took 2246 and 1110 us at 4096 tokens (1024 rows an
        # expert) against 2617 and 1276 on pointers, and 128x128 830 and 382 at 1024 tokens (256 rows) against 865
        # and 390, where 256x128 took 861 and 395. Where descriptors cannot read the operands, the pointer kernel
        # takes the same tiles: 256x128 on pointers also won at 4096 tokens, 128x128 at 4 stages at 1024
        # (855c0f1; docs/decisions/0037-moe-prefill-grouped-fp8-through-tma.md).
        many = per_expert > 512
        cfg.update(TMA=True, BLOCK_M=256 if many else 128, BLOCK_N=128, num_warps=8, num_stages=3 if many else 4)
    elif per_expert > 128 and channel_groups:
        # W4A8's channel groups past 128 rows an expert: 128x128 tiles through tensor descriptors on 8 warps, since
        # their scales are read one a thread (`gemm_fp8.channel_scales`). On Mixtral's experts (H100, `python -m
        # bench.grouped_tiles` at 3293a8d) gate/up and down took 2826 and 1371 us at 4096 tokens against 3814 and
        # 1872 on the 64x128 pointer tiles before, 3204 and 1655 at 128x128 on pointers; at 1024 tokens 930 and 426
        # against 1164 and 581. 256-row tiles spill (the partial beside the accumulator); decision record
        # 0038-w4a8-experts-channel-groups-through-tma.md.
        cfg.update(TMA=True, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)
    cfg.update(dict(overrides))
    if block_scales and (cfg["BLOCK_K"] != SCALE_BLOCK or (SCALE_BLOCK % cfg["BLOCK_N"] and not channel_groups)):
        raise ValueError(f"fxquant: block-scaled fp8 GEMM needs BLOCK_K == {SCALE_BLOCK} and BLOCK_N dividing "
                         f"{SCALE_BLOCK}, got BLOCK_K={cfg['BLOCK_K']} BLOCK_N={cfg['BLOCK_N']}")
    grid, split = _grid_and_split(M, N, K, E, cfg)
    meta = dict(COMPILER_PROMOTES=cfg.get("COMPILER_PROMOTES", not block_scales), BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # `gemm_grouped_tma` reads row scales and channel groups, not 128x128 blocks
    tma = cfg.get("TMA", False) and (channel_groups or not block_scales) and split == 1
    return grid, split, tma, meta


def grouped_fp8_mm(a, a_scale, offs, b, b_scale, out_dtype=torch.bfloat16, config=None, out=None):
    """a: [M, K] e4m3, rows sorted by expert; a_scale: [M, 1] per token, one element per tensor, or [M, K/128];
    offs: int32 [E]; b: [E, N, K] e4m3; b_scale: [E] per expert tensor, [E, N, 1] per channel, [E, N/128, K/128]
    blocks (with [M, K/128] activation scales) or [E, N, K/128] per channel and 1x128 group (with per-token or
    per-tensor activation scales: W4A8's codes made e4m3). Returns [M, N] in out_dtype, written into `out` if given
    (an [M, N] view, columns of a wider output). Past 128 rows an expert, row-scaled products on sm_90 go through
    torch's CUTLASS grouped GEMM where it takes them (`cutlass_grouped`, without a `config` or `out`); otherwise
    row-scaled tiles and channel groups past 128 rows an expert (or with a `config` of TMA=True) go through tensor
    descriptors (`gemm_grouped_tma`) where the GPU and the operands allow, unsplit; TMA=False keeps them on
    pointers."""
    M, K = a.shape
    E, N = b.shape[:2]
    _check_offs(offs, E)
    if b.shape[2] != K or a.dtype != b.dtype:
        raise ValueError(f"fxquant: grouped fp8 GEMM needs a [M, K] and b [E, N, K] of one fp8 dtype; got "
                         f"{tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    kb = cdiv(K, SCALE_BLOCK)
    per_tensor = b_scale.numel() == E
    channel_groups = not per_tensor and kb > 1 and tuple(b_scale.shape) == (E, N, kb)
    block_scales = channel_groups or (not per_tensor and b_scale.shape[1] != N)
    if channel_groups:
        if a_scale.numel() not in (1, M):
            raise ValueError(f"fxquant: weight scales per channel and 1x128 group [E, N, {kb}] take per-token or "
                             f"per-tensor activation scales, got {tuple(a_scale.shape)}")
        asm, ask = (0 if a_scale.numel() == 1 else a_scale.reshape(-1).stride(0)), 0
        bse, bsn, bsk = b_scale.stride()
    elif block_scales:
        if a_scale.shape != (M, kb) or b_scale.shape != (E, cdiv(N, SCALE_BLOCK), kb):
            raise ValueError(f"fxquant: 128x128 weight blocks [E, {cdiv(N, 128)}, {cdiv(K, 128)}] take 1x128 "
                             f"activation scales [M, {cdiv(K, 128)}], got {tuple(b_scale.shape)} and "
                             f"{tuple(a_scale.shape)}")
        asm, ask = a_scale.stride()
        bse, bsn, bsk = b_scale.stride()
    else:
        asm, ask = (0 if a_scale.numel() == 1 else a_scale.reshape(-1).stride(0)), 0
        b_scale = b_scale.reshape(E, -1)
        bse, bsn, bsk = b_scale.stride(0), (0 if per_tensor else b_scale.stride(1)), 0
    # row scales past 128 rows an expert on sm_90: CUTLASS's grouped GEMM, measured faster than the plan below
    # (docs/decisions/0039-moe-row-scaled-experts-on-cutlass.md)
    if config is None and out is None and not block_scales and not inlined() and \
            cutlass_supports(a, a_scale, b, b_scale, out_dtype) is None:
        return cutlass_grouped_fp8(a, a_scale, offs, b, b_scale)
    out = torch.empty((M, N), dtype=out_dtype, device=a.device) if out is None else out
    if M == 0 or N == 0:
        return out
    grid, split, tma, meta = _fp8_plan(M, N, K, E, block_scales, channel_groups,
                                       tuple(sorted((config or {}).items())))
    hopper = interpreting(_grouped_fp8_kernel) or (a.is_cuda and capability(a.device) >= (9, 0))
    if tma and hopper and not inlined() and tma_describable(a, b):
        launch_grouped_tma(a, offs, b, out, a_scale, b_scale, grid, (asm, bse, bsn, bsk), channel_groups=channel_groups,
                           out_tl=TORCH_TO_TL[out_dtype], cast=float_cast_mode(_grouped_fp8_kernel), meta=meta)
        return out
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    visible(_grouped_fp8_kernel)[grid](
        a, offs, b, out, ws, a_scale, b_scale,
        M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        asm, ask, bse, bsn, bsk,
        BLOCK_SCALES=block_scales, CHANNEL_GROUPS=channel_groups, SCALE_BLOCK=SCALE_BLOCK,
        OUT=TORCH_TO_TL[out_dtype], CAST=float_cast_mode(_grouped_fp8_kernel), SPLIT_K=split, **meta,
    )
    return _finish(ws, out, split, out_dtype)


@functools.lru_cache(maxsize=1024)
def _wo_plan(M: int, N: int, K: int, E: int, fmt: str, group: int, overrides: tuple):
    cfg = {**wo_gemm_config(cdiv(M, min(M, E)), K, fmt), **dict(overrides)}
    if fmt == "int4" and group % cfg["BLOCK_K"]:
        cfg["BLOCK_K"] = group  # one int4 group per K step, at least
    grid, split = _grid_and_split(M, N, K, E, cfg)
    meta = dict(EVEN_K=K % cfg["BLOCK_K"] == 0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], PAIR_ORDER=cfg.get("PAIR_ORDER", False) and fmt in PACKED)
    return grid, split, meta


# Experts rewritten for a vendor's grouped GEMM past 128 rows an expert (weight-only ones dequantized to bf16 for
# grouped_mm, W4A8's row-scaled codes made e4m3 for CUTLASS) go in one product up to this many weight elements
# (Mixtral's gate/up are 0.94 G: a transient 1.9 GB in bf16, 0.94 GB in e4m3), in blocks of columns past it, so that
# the copy stays bounded for larger expert sets (DeepSeek-V3's 7.5 G). In blocks of 2**27 CUTLASS's W4A8 ran 0.36x
# bf16 on Mixtral's down against 1.29x whole (decision 0040), and weight-only int4 0.85x at 4096 tokens against 0.95x
# (docs/decisions/0041-experts-rewritten-whole-for-vendor-grouped-gemms.md).
EXPERTS_AT_ONCE_ELEMENTS = 2**30


def grouped_weight_only_mm(a, offs, w, w_scale, fmt: str, group: int, N: int, *, zero_point=None,
                           global_scale=None, config=None):
    """a: [M, K] bf16/fp16 (bf16 for mxfp8), rows sorted by expert; offs: int32 [E]; w: [E, N, K] int8 / e4m3 or
    [E, N, K/2] packed 4-bit codes; w_scale: [E, N, ...] as `weight_only_mm` takes each expert's; zero_point: like
    w_scale; global_scale: NVFP4's fp32 [E]. Returns [M, N] in a's dtype. Up to DEQUANTIZE_ABOVE_M rows per active
    expert, or given an explicit tile `config`, every expert's codes are decoded in registers; past it bf16
    activations take the experts dequantized and `torch._grouped_mm`, as the dense product takes cuBLAS (outside a
    package's trace, whose kernels stay the ones it was tested with)."""
    M, K = a.shape
    E = w.shape[0]
    _check_offs(offs, E)
    codes, scale = weight_operands(a, w, w_scale, fmt, group, N)
    if zero_point is not None and zero_point.stride() != scale.stride():
        raise ValueError("fxquant: int4 zero points must share the scales' layout [E, N, K/group]")
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=a.dtype, device=a.device)
    if config is None and a.dtype == torch.bfloat16 and cdiv(M, min(M, E)) > DEQUANTIZE_ABOVE_M and not inlined():
        return _grouped_dequantized_mm(a, offs, codes, scale, fmt, group, zero_point, global_scale)
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    grid, split, meta = _wo_plan(M, N, K, E, fmt, group, tuple(sorted((config or {}).items())))
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    visible(_grouped_wo_kernel)[grid](
        a, offs, codes, scale, zero_point if zero_point is not None else scale,
        global_scale if global_scale is not None else scale, out, ws,
        M, N, K, E,
        a.stride(0), a.stride(1), codes.stride(0), codes.stride(1), codes.stride(2), scale.stride(0),
        scale.stride(1), scale.stride(2), out.stride(0), out.stride(1),
        FMT=FORMATS[fmt], GROUP=group or 1, HAS_ZP=zero_point is not None, SPLIT_K=split,
        DOT=tl.float32 if interpreting(_grouped_wo_kernel) else TORCH_TO_TL[a.dtype], OUT=TORCH_TO_TL[a.dtype],
        CAST=float_cast_mode(_grouped_wo_kernel), **meta,
    )
    return _finish(ws, out, split, a.dtype)


def _grouped_dequantized_mm(a, offs, codes, scale, fmt, group, zero_point, global_scale):
    """Each expert's rows of a times that expert dequantized to a's dtype (rounded once, as the dense product past
    DEQUANTIZE_ABOVE_M rounds it), by torch._grouped_mm: every column at once up to EXPERTS_AT_ONCE_ELEMENTS of
    dequantized weight, in blocks of columns past it; rows past offs[-1] are zero, as the kernels leave them (zeroed
    on the device, where grouped_mm leaves them unwritten: with every row owned no pass over the product)."""
    (M, K), (E, N) = a.shape, codes.shape[:2]
    columns = max(16, EXPERTS_AT_ONCE_ELEMENTS // (E * K) // 16 * 16)  # whole 16-element blocks, grouped_mm's alignment
    out = torch.empty((M, N), dtype=a.dtype, device=a.device) if columns < N else None
    for n0 in range(0, N, columns):
        n1 = min(N, n0 + columns)
        weights = dequantize_weight(codes[:, n0:n1], scale[:, n0:n1], fmt, group, K, a.dtype,  # every expert's
                                    zero_point=None if zero_point is None else zero_point[:, n0:n1],
                                    global_scale=global_scale)
        product = torch._grouped_mm(a, weights.transpose(1, 2), offs=offs)
        if out is None:
            return zero_unowned_rows(product, offs)
        out[:, n0:n1] = product
    return zero_unowned_rows(out, offs)


# W4A8 experts past this many rows an active expert go expert by expert through the dense product (cuBLAS), the
# offsets read on the host; from CUBLAS_ABOVE_M up to it, through the codes made e4m3 and the grouped fp8 kernel, with
# no host read. On Mixtral's experts (H100, `python -m bench.grouped_tiles` at 3293a8d, the channel groups through
# TMA), at 256 rows an expert (1024 tokens) the grouped route took gate/up 1426 and down 788 us in a graph against
# 1617 and 1430 expert by expert as it runs; at 1024 rows (4096 tokens) 3425 and 1813 against 3315 and 1733. Between
# the two it is not timed: 512 splits them (docs/decisions/0036-moe-prefill-grouped-gemm-order-and-routes.md).
BY_EXPERT_ABOVE_M = 512


@functools.lru_cache(maxsize=1024)
def _int4_fp8_plan(M: int, N: int, K: int, E: int, overrides: tuple):
    """The dense W4A8 kernel's tiles at the average rows per active expert (past 128 rows, the tiles its sweep found
    best: the dense product hands those rows to cuBLAS, which has no grouped W4A8 form); one K step per group."""
    cfg = {**int4_fp8_config(cdiv(M, min(M, E)), N), **dict(overrides), "BLOCK_K": INT4_GROUP}
    grid, split = _grid_and_split(M, N, K, E, cfg)
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], PAIR_ORDER=cfg.get("PAIR_ORDER", False))
    return grid, split, meta


def grouped_int4_fp8_mm(a, a_scale, offs, w, w_scale, zero_point, out_dtype=torch.bfloat16, config=None,
                        row_scale=None):
    """W4A8 over rows sorted by expert: a [M, K] e4m3 with per-token scales a_scale [M, 1]; offs: int32 [E];
    w: [E, N, K/2] packed int4 codes with scales [E, N, K/128] fp32 and zero points like them (or None: symmetric).
    Returns [M, N] in out_dtype, each group's fp32 partial scaled as `int4_fp8_mm` scales it. Past CUBLAS_ABOVE_M
    rows per active expert (outside a package's trace and without an explicit `config`) the codes are made e4m3 for
    the grouped fp8 kernel; past BY_EXPERT_ABOVE_M, outside a CUDA graph capture, each expert's rows take the dense
    product (`int4_fp8_mm`, cuBLAS's GEMM past 128 rows): the one grouped route that reads the expert offsets on the
    host, which a graph cannot. row_scale: [E, N, 1] where w_scale is in the row-scaled form
    (numerics/row_powers_of_two.py): those routes multiply the codes row-scaled (CUTLASS's grouped GEMM, cuBLAS's
    rowwise one) rather than scaling each group's partial."""
    M, K = a.shape
    E, N = w.shape[:2]
    _check_offs(offs, E)
    if w.shape != (E, N, K // 2) or w_scale.shape != (E, N, K // INT4_GROUP) or a_scale.numel() != M:
        raise ValueError(f"fxquant: grouped int4 x fp8 GEMM needs a [M, K], per-token scales [M, 1], codes [E, N, K/2] "
                         f"and scales [E, N, K/{INT4_GROUP}] for K = {K}; got {tuple(a.shape)}, "
                         f"{tuple(a_scale.shape)}, {tuple(w.shape)} and {tuple(w_scale.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    per_expert = cdiv(M, min(M, E))
    if config is None and per_expert > CUBLAS_ABOVE_M and not inlined():
        if per_expert <= BY_EXPERT_ABOVE_M or (a.is_cuda and torch.cuda.is_current_stream_capturing()):
            return grouped_int4_fp8_over_e4m3(out, a, a_scale, offs, w, w_scale, zero_point, row_scale)
        return grouped_int4_fp8_by_expert(out, a, a_scale, offs, w, w_scale, zero_point, row_scale)
    a, scale = a.contiguous(), w_scale.contiguous()
    words = w.contiguous().view(torch.uint8).view(torch.int32)  # eight codes a word (K is a multiple of 128)
    zero = zero_point.contiguous() if zero_point is not None else scale
    grid, split, meta = _int4_fp8_plan(M, N, K, E, tuple(sorted((config or {}).items())))
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    visible(_grouped_int4_fp8_kernel)[grid](
        as_words(a), a_scale.reshape(M).contiguous(), offs, words, scale, zero, out, ws, M, N, K, E,
        K // 4, words.stride(0), words.stride(1), scale.stride(0), scale.stride(1), out.stride(0),
        HAS_ZP=zero_point is not None, SPLIT_K=split, OUT=TORCH_TO_TL[out_dtype],
        CAST=cast_mode(_grouped_int4_fp8_kernel, a.device), GROUP=INT4_GROUP,
        DOT=dot_type(_grouped_int4_fp8_kernel), **meta,
    )
    return _finish(ws, out, split, out_dtype)


def grouped_int4_fp8_over_e4m3(out, a, a_scale, offs, w, w_scale, zero_point, row_scale=None):
    """W4A8 experts on the fp8 tensor cores with no host read of the offsets: every expert's codes made e4m3
    integers q - z (`int4_as_e4m3`, exact), a block of columns at a time (at most CHUNK_ELEMENTS codes), each block
    through the grouped fp8 kernel with the group's scales and the token's folded into each 128-wide K step's fp32
    partial, written into its columns of `out` [M, N]. With row scales [E, N, 1] the codes take their groups' powers
    of two, every column at once up to EXPERTS_AT_ONCE_ELEMENTS (one row-scaled grouped product, CUTLASS's on sm_90,
    returning a new output; docs/decisions/0040-w4a8-row-scaled-past-m128.md), past it in blocks of columns written
    into `out`."""
    (M, K), (E, N) = a.shape, w.shape[:2]
    if row_scale is not None:
        columns = max(16, EXPERTS_AT_ONCE_ELEMENTS // (E * K) // 16 * 16)
        if columns >= N:
            return grouped_fp8_mm(a, a_scale.reshape(M, 1), offs, int4_as_e4m3(w, zero_point, w_scale, row_scale),
                                  row_scale, out.dtype)
        for n0 in range(0, N, columns):
            n1 = min(N, n0 + columns)
            codes = int4_as_e4m3(w[:, n0:n1], None if zero_point is None else zero_point[:, n0:n1],
                                 w_scale[:, n0:n1], row_scale[:, n0:n1])
            out[:, n0:n1] = grouped_fp8_mm(a, a_scale.reshape(M, 1), offs, codes, row_scale[:, n0:n1], out.dtype)
        return out
    columns = max(16, CHUNK_ELEMENTS // (E * K) // 16 * 16)  # whole 16-column blocks
    for n0 in range(0, N, columns):
        n1 = min(N, n0 + columns)
        codes = int4_as_e4m3(w[:, n0:n1], None if zero_point is None else zero_point[:, n0:n1])
        grouped_fp8_mm(a, a_scale.reshape(M, 1), offs, codes, w_scale[:, n0:n1], out.dtype, out=out[:, n0:n1])
    return out


def grouped_int4_fp8_by_expert(out, a, a_scale, offs, w, w_scale, zero_point, row_scale=None):
    """Each expert's rows through the dense W4A8 product, written into out; rows no expert owns are zero. The
    offsets come to the host once (the experts' row counts pick each product's route)."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = int4_fp8_mm(a[start:end], a_scale.reshape(-1, 1)[start:end], w[e], w_scale[e],
                                         None if zero_point is None else zero_point[e], None, out.dtype,
                                         row_scale=None if row_scale is None else row_scale[e])
        start = max(start, end)
    out[start:] = 0
    return out
