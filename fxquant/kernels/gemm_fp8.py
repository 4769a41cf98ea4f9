"""FP8 scaled GEMM: out[M, N] = (A[M, K] * a_scale) @ (B[N, K] * b_scale).T (+ bias), fp32 accumulation.

Accumulation precision: on sm_90 an fp8 `tl.dot` accumulates in the tensor cores' reduced-precision
accumulator; every BLOCK_K (128) step is added into the fp32 accumulator, so the imprecise span is 128.
Row scales let the compiler do that promotion (`max_num_imprecise_acc`), which keeps the wgmma pipeline
running; block scales promote by hand, since each K step's partial is scaled anyway. Measured on an H200:
1.28e-4 relative error against the fp64 product at K = 4096 and 14336 either way, and 780-830 TF/s for the
compiler's promotion against 410-430 by hand at M >= 1024 (docs/decisions/0002-fp8-row-scales-compiler-promotion.md).

Two scale layouts:
- row scales (per tensor, per token, per channel): a_scale [M] (stride 0 for per tensor), b_scale [N]
  (stride 0 for per tensor), applied once in the epilogue, since they are constant along K;
- block scales (1x128 activations, 128x128 weights): a_scale [M, K/128], b_scale [N/128, K/128], folded into
  the fp32 accumulator at every 128-wide K step, since they change along K.
M/N/K tails are masked. Tile shapes come from `gemm_configs.py`, tuned per M bucket on the H200. A config with
SWAP_AB (row scales) computes (B @ A.T).T: the weight's rows become the MMA's M, so a decode tile of 16 tokens runs
wgmma on the fp8 codes as stored (108 instructions a K step at 40 registers on sm_90, against 154 at 70 for the fp16
MMA after a conversion, `python -m bench.sass fp8 [--swap]`). No default takes it: it was faster, and less exact
(docs/decisions/0023-decode-gemm-operands-as-given.md). A config with WEIGHT_TMA reads the weight's tiles through a
tensor descriptor (the layer chain's candidate, `bench.chain_tiles`); no default takes it until the GPU times it.
Small M splits K across programs (`splitk.py`); the row scales are linear, so each K slice applies them to its
partial, and the slice that finishes last for a tile sums them.
Past M = 128 on sm_90+, operands that tensor descriptors can read go to the persistent TMA kernel
(`gemm_fp8_tma.py`), about 20% faster there than this one (docs/decisions/0003-persistent-tma-fp8-gemm.md).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fxquant.kernels.cast import capability, float_cast_mode, interpreting
from fxquant.kernels.dependent_launch import (
    await_previous,
    launch_options,
    prefetch_l2,
    prefetching,
    start_next,
    steps_ahead,
)
from fxquant.kernels.gemm_configs import fp8_gemm_config
from fxquant.kernels.gemm_fp8_tma import describable, launch_tma
from fxquant.kernels.launch import cdiv, sm_count, visible
from fxquant.kernels.splitk import counters, reduce_partials, split_k, sum_if_last_slice
from fxquant.kernels.tiles import k_steps_of, store_tile, tile_offsets

SCALE_BLOCK = 128  # the 1x128 / 128x128 scale block
TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def channel_scales(scale_ptr, offs_n, mask_n, k, stride_sn, stride_sk):
    """Group k's weight scales [BLOCK_N] of the tile's columns, read one a thread and moved into the accumulator's
    layout through shared memory. Loaded as [BLOCK_N, 2], the second column masked off and summed away: Triton
    deems a load of fewer elements than the program has threads cheap and reloads it in each consumer's layout, which
    for a column vector of a wgmma accumulator on 8 warps is 32 scalar loads a thread every K step, 300 instructions
    a step and 254 registers at 128x128 against 209 and 218 this way (sm_90, `python -m bench.sass grouped
    --channel-groups`; docs/decisions/0038-w4a8-experts-channel-groups-through-tma.md)."""
    pair = tl.arange(0, 2)
    scales = tl.load(scale_ptr + offs_n[:, None] * stride_sn + (k * stride_sk + pair[None, :]),
                     mask=mask_n[:, None] & (pair[None, :] == 0), other=0.0)
    return tl.sum(scales, axis=1)  # x + 0.0: exact


@triton.jit
def fp8_accumulate(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, offs_m, offs_n, pid_n, M, N, K, first_k, last_k,
                   stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn, stride_bsk,
                   BLOCK_SCALES: tl.constexpr, SCALE_BLOCK: tl.constexpr, COMPILER_PROMOTES: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   CHANNEL_GROUPS: tl.constexpr, b_desc, WEIGHT_TMA: tl.constexpr):
    """The fp32 tile A[offs_m] @ B[offs_n].T over K steps [first_k, last_k), block scales folded in at each step;
    row scales are left to `fp8_scale_tile`. CHANNEL_GROUPS (with BLOCK_SCALES): the weight's scales are per row and
    1x128 group [N, K/128], as W4A8's codes made e4m3 carry them, and the activations' per token (stride_ask unread).
    WEIGHT_TMA: B's tiles come through the tensor descriptor b_desc [N, K] of block [BLOCK_N, BLOCK_K] (the copy
    engine fills shared memory and zero-fills the tails), A's through pointers."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
    mask_m, mask_n = offs_m < M, offs_n < N

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs += first_k * BLOCK_K * stride_ak
    b_ptrs += first_k * BLOCK_K * stride_bk
    for k in range(first_k, last_k):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)  # [BM, BK]
        if WEIGHT_TMA:
            b = tl.trans(b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]))  # [BK, BN]
        else:
            b = tl.load(b_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)  # [BK, BN]
        if BLOCK_SCALES:
            # BLOCK_K == SCALE_BLOCK: one activation scale per row and one weight scale per tile (per column with
            # CHANNEL_GROUPS) at this K step; each step's fp32 partial is scaled before it joins the accumulator,
            # since the fp8 MMA's own accumulator keeps fewer bits (docs/decisions/0002).
            if CHANNEL_GROUPS:
                # the token's scale is constant along K: applied once, after the loop, as the W4A8 kernel does
                acc += tl.dot(a, b) * channel_scales(b_scale_ptr, offs_n, mask_n, k, stride_bsn, stride_bsk)[None, :]
            else:
                a_s = tl.load(a_scale_ptr + offs_m * stride_asm + k * stride_ask, mask=mask_m, other=0.0)
                b_s = tl.load(b_scale_ptr + (pid_n * BLOCK_N // SCALE_BLOCK) * stride_bsn + k * stride_bsk)
                acc += tl.dot(a, b) * (a_s[:, None] * b_s)
        elif COMPILER_PROMOTES:
            # The compiler adds the MMA's partial into an fp32 accumulator every BLOCK_K, keeping wgmma async.
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            # A fresh dot per K step, added in fp32: Hopper's fp8 MMA accumulates with a short mantissa,
            # so promoting every 128 K keeps the error near fp32's (1e-3 -> 1e-4 relative at K = 4096).
            # Kept to compare with the compiler's promotion (bench/fp8_gemm.py).
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if CHANNEL_GROUPS:
        acc *= tl.load(a_scale_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)[:, None]
    return acc


@triton.jit
def fp8_accumulate_swapped(a_ptr, b_ptr, offs_m, offs_n, M, N, K, first_k, last_k, stride_am, stride_ak, stride_bn,
                           stride_bk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp8_accumulate for row scales with the operands swapped: (B[offs_n] @ A[offs_m].T).T, so that the weight's
    BLOCK_N rows are the MMA's M (64 and up: wgmma on sm_90, fp8 operands as stored) and the few tokens its N."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[None, :].to(tl.int64) * stride_am + offs_k[:, None] * stride_ak  # A.T tile [BK, BM]
    b_ptrs = b_ptr + offs_n[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_bk  # B tile [BN, BK]
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    a_ptrs += first_k * BLOCK_K * stride_ak
    b_ptrs += first_k * BLOCK_K * stride_bk
    for k in range(first_k, last_k):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=mask_m[None, :] & (offs_k[:, None] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[:, None] & (offs_k[None, :] < k_left), other=0.0)
        # The compiler adds each BLOCK_K step's partial into fp32, as fp8_accumulate's row-scale path.
        acc = tl.dot(b, a, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return tl.trans(acc)


@triton.jit
def prefetch_weight_steps(b_ptr, offs_n, N, stride_bn, stride_bk, first_k, last_k, BLOCK_K: tl.constexpr):
    """Ask the L2 for the first K steps of the weight rows offs_n in [first_k, last_k): one 128-byte line a row and
    step at BLOCK_K = 128 (decision 0030)."""
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # a tile past N asks for the last row again
    columns = steps_ahead(first_k, last_k) * BLOCK_K
    prefetch_l2(b_ptr + rows[:, None] * stride_bn + columns[None, :] * stride_bk)


@triton.jit
def fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, stride_asm, stride_bsn,
                   BLOCK_SCALES: tl.constexpr):
    """Row scales (per tensor, token, channel), constant along K, applied once to the tile."""
    if not BLOCK_SCALES:
        a_s = tl.load(a_scale_ptr + offs_m * stride_asm, mask=offs_m < M, other=0.0)
        b_s = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=offs_n < N, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def _fp8_gemm_kernel(
    # pointers, and the weight's tensor descriptor where WEIGHT_TMA reads through it (b_ptr again where not)
    a_ptr, b_ptr, c_ptr, ws_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, counter_ptr, b_desc,
    # sizes
    M, N, K,
    # strides
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bsn, stride_bsk,
    # meta-parameters
    BLOCK_SCALES: tl.constexpr, SCALE_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
    CAST: tl.constexpr, SPLIT_K: tl.constexpr, LAST_SLICE_SUMS: tl.constexpr, COMPILER_PROMOTES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
    SWAP_AB: tl.constexpr, WEIGHT_TMA: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    if not PREFETCH:
        await_previous(PDL)
    pid_k = tl.program_id(1)
    pid_m, pid_n, offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    if PREFETCH:  # no kernel writes the weight: the L2 fetches its first K steps while the previous kernel ends
        prefetch_weight_steps(b_ptr, offs_n, N, stride_bn, stride_bk, first_k, last_k, BLOCK_K)
        await_previous(PDL)
    if SWAP_AB:
        acc = fp8_accumulate_swapped(a_ptr, b_ptr, offs_m, offs_n, M, N, K, first_k, last_k, stride_am, stride_ak,
                                     stride_bn, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = fp8_accumulate(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, offs_m, offs_n, pid_n, M, N, K, first_k, last_k,
                             stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_ask, stride_bsn,
                             stride_bsk, BLOCK_SCALES, SCALE_BLOCK, COMPILER_PROMOTES, BLOCK_M, BLOCK_N, BLOCK_K,
                             False, b_desc, WEIGHT_TMA)
    # The next kernel launches after the K loop: resident earlier, its waiting programs took this one's slots
    # (the decode GEMM chain at B16: 88.4 -> 86.2 us a layer, bench.split_sums).
    start_next(PDL)
    acc = fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, stride_asm, stride_bsn, BLOCK_SCALES)
    store_tile(acc, c_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, pid_k,
               HAS_BIAS, SPLIT_K, OUT, CAST)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, c_ptr, bias_ptr, counter_ptr, tl.program_id(0), offs_m, offs_n, M, N,
                          stride_cm, stride_cn, HAS_BIAS, SPLIT_K, OUT, CAST)


def is_block_scaled(a_scale: torch.Tensor, b_scale: torch.Tensor, N: int) -> bool:
    """1x128 / 128x128 scales vary along K (more than one column) or cover 128 rows of B each."""
    return (a_scale.dim() == 2 and a_scale.shape[1] > 1) or (b_scale.dim() == 2 and 1 < b_scale.shape[0] < N)


@functools.lru_cache(maxsize=1024)
def _launch_plan(M: int, N: int, K: int, block_scales: bool, tma_ready: bool,
                 overrides: tuple) -> tuple[int, int, bool, dict]:
    """(output tiles, K slices, whether the TMA kernel runs it, tile meta-parameters) of a product; tma_ready: the
    GPU has TMA (the caller asks again with False where descriptors cannot read the operands). The same for every
    call at a shape, so worked out once. overrides: (name, value) pairs replacing the bucket's config, e.g. from
    a sweep."""
    cfg = {**fp8_gemm_config(M, N, K, block_scales, tma_ready), **dict(overrides)}
    if block_scales and (cfg["BLOCK_K"] != SCALE_BLOCK or SCALE_BLOCK % cfg["BLOCK_N"]):
        # One activation scale per K step and one weight scale per tile: any other tiling reads wrong scales.
        raise ValueError(f"fxquant: block-scaled fp8 GEMM needs BLOCK_K == {SCALE_BLOCK} and BLOCK_N dividing "
                         f"{SCALE_BLOCK}, got BLOCK_K={cfg['BLOCK_K']} BLOCK_N={cfg['BLOCK_N']}")
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    # Configs that name a program target split K toward it (decode, and medium M where the sweep chose it).
    split = cfg.get("SPLIT_K") or (split_k(tiles, cdiv(K, cfg["BLOCK_K"]), cfg["programs"]) if "programs" in cfg
                                   else 1)
    promotes = cfg.get("COMPILER_PROMOTES", not block_scales)
    # the swapped loop takes row scales, and leaves the fp32 promotion to the compiler
    swap = cfg.get("SWAP_AB", False) and not block_scales and promotes
    meta = dict(COMPILER_PROMOTES=promotes, SWAP_AB=swap, WEIGHT_TMA=cfg.get("WEIGHT_TMA", False) and not swap,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return tiles, split, tma_ready and cfg.get("TMA", False) and split == 1, meta


def fp8_scaled_mm(a, a_scale, b, b_scale, bias=None, out_dtype=torch.bfloat16, config=None):
    """a: [M, K] fp8; b: [N, K] fp8 (a weight, as F.linear takes it); returns [M, N] in out_dtype.

    Row scales: a_scale [M, 1] or one element, b_scale [N, 1] or one element.
    Block scales: a_scale [M, K/128] (1x128 groups), b_scale [N/128, K/128] (128x128 blocks).
    """
    M, K = a.shape
    N = b.shape[0]
    if b.shape[1] != K or a.dtype != b.dtype:
        raise ValueError(f"fxquant: fp8_scaled_mm needs a [M, K] and b [N, K] of one fp8 dtype; "
                         f"got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    block_scales = is_block_scaled(a_scale, b_scale, N)
    if block_scales:
        kb = cdiv(K, SCALE_BLOCK)
        want_a, want_b = (M, kb), (cdiv(N, SCALE_BLOCK), kb)
        if tuple(a_scale.shape) != want_a or tuple(b_scale.shape) != want_b:
            raise ValueError(f"fxquant: block-scaled fp8 GEMM needs a_scale {want_a} and b_scale {want_b}, got "
                             f"{tuple(a_scale.shape)} and {tuple(b_scale.shape)}")
        asm, ask = a_scale.stride()
        bsn, bsk = b_scale.stride()
    else:
        asm = 0 if a_scale.numel() == 1 else a_scale.reshape(-1).stride(0)
        bsn = 0 if b_scale.numel() == 1 else b_scale.reshape(-1).stride(0)
        ask = bsk = 0
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    overrides = tuple(sorted((config or {}).items()))
    tma_capable = interpreting(_fp8_gemm_kernel) or capability(a.device) >= (9, 0)
    tiles, split, tma, meta = _launch_plan(M, N, K, block_scales, tma_capable, overrides)
    if tma and not describable(a, b):  # checked only where the plan wants TMA: decode's host path skips it
        tiles, split, tma, meta = _launch_plan(M, N, K, block_scales, False, overrides)
    if tma:
        launch_tma(a, b, out, a_scale, b_scale, bias, (out.stride(0), out.stride(1), asm, ask, bsn, bsk),
                   block_scales=block_scales, scale_block=SCALE_BLOCK, out_tl=TORCH_TO_TL[out_dtype],
                   cast=float_cast_mode(_fp8_gemm_kernel), cfg=meta, sms=sm_count(a.device))
        return out
    if meta["WEIGHT_TMA"] and not describable(b):
        meta = {**meta, "WEIGHT_TMA": False}
    b_desc = TensorDescriptor.from_tensor(b, [meta["BLOCK_N"], meta["BLOCK_K"]]) if meta["WEIGHT_TMA"] else b
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    count = counters(a.device, tiles) if split > 1 else None
    pdl = launch_options(a.device)
    visible(_fp8_gemm_kernel)[(tiles, split)](
        a, b, out, ws, a_scale, b_scale, bias if bias is not None else out, count if count is not None else ws, b_desc,
        M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        asm, ask, bsn, bsk,
        BLOCK_SCALES=block_scales, SCALE_BLOCK=SCALE_BLOCK, HAS_BIAS=bias is not None, OUT=TORCH_TO_TL[out_dtype],
        CAST=float_cast_mode(_fp8_gemm_kernel), SPLIT_K=split, LAST_SLICE_SUMS=count is not None, **meta,
        # the first weights asked of the L2 before the wait (docs/decisions/0030-fp8-decode-weights-prefetched.md)
        PREFETCH=prefetching(pdl, by_default=True), **pdl,
    )
    if split > 1 and count is None:
        reduce_partials(ws, out, bias, TORCH_TO_TL[out_dtype])
    return out
