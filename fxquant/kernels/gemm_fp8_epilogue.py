"""The decode fp8 GEMM with the row work after it in its epilogue: one kernel where two launch today.
- NORM: the residual add, the norm and the fp8 quantizer after the o- and down-projections (`fp8_scaled_mm` then
  `norm_quant_fp8(residual, ..., residual=product)`);
- SILU: SiLU(gate) x up and its fp8 quantizer after the merged gate/up projection (`fp8_scaled_mm` then
  `silu_mul_quantize_fp8_rows`, per token).
Every kernel of a decode layer costs 2-3 us of launch and tail at B1 against a few us of bytes; each epilogue is a
kernel fewer.

Each output tile is finished where `fp8_scaled_mm` finishes it (split along K: by its last slice, summing the slices'
partials in slice order), then rounded to the model's dtype as that GEMM stores it: stored as it is (SILU), or added
to the residual in fp32 and rounded once, as the norm kernel adds (NORM: the residual stream). Then the tile counts
itself in at a counter for the whole GEMM; the program that counts last has every tile's result before it
(acquire-release at GPU scope, read through L2) and runs the row code of the kernel it stands for over the M rows:
`norm_quant_row`, or `silu_mul_quant_row` (the SiLU kernel's math in chunks of a row). So what is stored is the two
kernels' bits, and SILU's codes too (elementwise products and a max); the norm's statistics sum in this kernel's
thread layout, which on a GPU may round the variance an fp32 ulp apart from the norm kernel's (Triton's interpreter
sums both alike: the CPU tests compare bits).

Row scales (per token, per channel, per tensor) and M <= MAX_ROWS only, on the split-K decode plans and the tile
counters of `splitk.py`; anything else runs the two kernels. The ops `scaled_mm_fp8_add_norm_quant` and
`scaled_mm_fp8_silu_mul_quantize` run it, which the pass fuse_gemm_epilogue inserts where `enable_passes` names it:
off by default until the decode step measures it faster (`python -m bench.gemm_epilogue` times a decode layer's GEMM
chain with and without each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability, cast_float, cast_mode, interpreting
from fxquant.kernels.dependent_launch import await_previous, launch_options, start_next
from fxquant.kernels.gemm_fp8 import (
    TORCH_TO_TL,
    _launch_plan,
    fp8_accumulate,
    fp8_scale_tile,
    fp8_scaled_mm,
    is_block_scaled,
)
from fxquant.kernels.launch import next_power_of_2, visible
from fxquant.kernels.norm_quant_fp8 import E4M3_MAX, norm_quant_fp8, norm_quant_row
from fxquant.kernels.norm_quant_fp8 import supports as norm_supports
from fxquant.kernels.quant_fp8 import row_refusal, silu_mul_quant_row, silu_mul_quantize_fp8_rows
from fxquant.kernels.splitk import counters
from fxquant.kernels.tiles import k_steps_of, tile_offsets
from fxquant.numerics.formats import AMAX_FLOOR

NORM, SILU = 1, 2  # the EPILOGUE constexpr
# The last tile runs every row itself, so rows are few: a decode batch's. SiLU's row reads 14x the norm's values at
# Llama-3-8B's shape (gate and up, 14336 wide each, read twice; the norm's 4096, once): fewer of them. Both caps are
# first guesses, which bench.gemm_epilogue's B1 / B4 / B16 columns measure.
MAX_ROWS = {NORM: 16, SILU: 4}
SILU_CHUNK = 2048  # SiLU x up's row in chunks: a 14336-wide row whole would not fit the GEMM's registers


@triton.jit
def add_as_written(x, y, CAST: tl.constexpr):
    """x + y in fp32, as written: an fp32 model's product is not rounded by a cast, so the compiler contracted its
    scale's multiply and this add into one fma, skipping the rounding of the product that the unfused GEMM stores
    (the H200 at 12e4074: h differed from the two kernels' in fp32). PTX's add.rn is never contracted. The
    interpreter (CAST_EMULATED) runs no PTX and contracts nothing."""
    if CAST == 2:
        return x + y
    return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _finish_tile(acc, bias_ptr, res_ptr, h_ptr, counter_ptr, w_ptr, nb_ptr, codes_ptr, scales_ptr, offs_m, offs_n,
                 M, N, n_groups, eps, EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, LP: tl.constexpr,
                 CAST: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, GROUP: tl.constexpr,
                 FMAX: tl.constexpr, FP8: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_D: tl.constexpr):
    """The tile's full fp32 sum, biased and rounded as the GEMM stores it: added to the residual (NORM) or as it is
    (SILU), stored in h; the last tile to finish then runs every row, and zeroes the GEMM's counter."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    y = cast_float(acc, LP, CAST)  # the product as fp8_scaled_mm stores it
    at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if EPILOGUE == 1:
        # The add in fp32 of the two rounded operands, rounded once: the norm kernel's residual add, bit for bit.
        y = cast_float(add_as_written(y.to(tl.float32), tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32),
                                      CAST), LP, CAST)
    tl.store(h_ptr + at, y, mask=mask)
    tl.debug_barrier()  # every thread's part of the tile is stored before the count releases it
    tiles = tl.num_programs(0)
    done = tl.atomic_add(counter_ptr + tiles, 1, sem="acq_rel", scope="gpu")
    if done == tiles - 1:
        for row in range(M):
            if EPILOGUE == 1:
                norm_quant_row(h_ptr, h_ptr, w_ptr, nb_ptr, codes_ptr, scales_ptr, h_ptr, h_ptr, row, N, n_groups, eps,
                               RMS, False, HAS_W, HAS_B, LP, GROUP, FMAX, FP8, CAST, AMAX_FLOOR, BLOCK_D, False, True)
            else:
                silu_mul_quant_row(h_ptr, codes_ptr, scales_ptr, row, N // 2, LP, FMAX, FP8, CAST, AMAX_FLOOR,
                                   BLOCK_D)
        tl.store(counter_ptr + tiles, 0)  # the next kernel that counts waits for this one to end


@triton.jit
def _fp8_gemm_epilogue_kernel(
    # pointers
    a_ptr, b_ptr, ws_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, counter_ptr, res_ptr, h_ptr, w_ptr, nb_ptr, codes_ptr,
    scales_ptr,
    # sizes
    M, N, K, n_groups, eps,
    # strides
    stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_bsn,
    # meta-parameters
    EPILOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, LP: tl.constexpr, CAST: tl.constexpr, SPLIT_K: tl.constexpr,
    COMPILER_PROMOTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    GROUP: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_D: tl.constexpr,
):
    await_previous(PDL)
    pid_k = tl.program_id(1)
    tile = tl.program_id(0)
    pid_m, pid_n, offs_m, offs_n = tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    acc = fp8_accumulate(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, offs_m, offs_n, pid_n, M, N, K, first_k, last_k,
                         stride_am, stride_ak, stride_bn, stride_bk, stride_asm, 0, stride_bsn, 0, False, BLOCK_K,
                         COMPILER_PROMOTES, BLOCK_M, BLOCK_N, BLOCK_K)
    start_next(PDL)  # after the K loop, as fp8_scaled_mm's kernel
    acc = fp8_scale_tile(acc, a_scale_ptr, b_scale_ptr, offs_m, offs_n, M, N, stride_asm, stride_bsn, False)
    if SPLIT_K == 1:
        _finish_tile(acc, bias_ptr, res_ptr, h_ptr, counter_ptr, w_ptr, nb_ptr, codes_ptr, scales_ptr, offs_m, offs_n,
                     M, N, n_groups, eps, EPILOGUE, HAS_BIAS, LP, CAST, RMS, HAS_W, HAS_B, GROUP, FMAX, FP8,
                     AMAX_FLOOR, BLOCK_D)
    else:
        # splitk.sum_if_last_slice's protocol and order, so the sum is fp8_scaled_mm's
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        at = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + at, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(ws_ptr + s * M * N + at, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(counter_ptr + tile, 0)
            _finish_tile(acc, bias_ptr, res_ptr, h_ptr, counter_ptr, w_ptr, nb_ptr, codes_ptr, scales_ptr, offs_m,
                         offs_n, M, N, n_groups, eps, EPILOGUE, HAS_BIAS, LP, CAST, RMS, HAS_W, HAS_B, GROUP, FMAX,
                         FP8, AMAX_FLOOR, BLOCK_D)


def _plan(epilogue, a, a_scale, b, b_scale, config) -> tuple[str | None, tuple]:
    """(why the GEMM's plan keeps the epilogue out, or None; the plan: tiles, split, meta-parameters, counters). Made
    once a call: the decode step's host time pays for each."""
    M, K = a.shape
    N = b.shape[0]
    if is_block_scaled(a_scale, b_scale, N):
        return "block scales (the fused epilogue takes row scales)", ()
    if not 1 <= M <= MAX_ROWS[epilogue]:
        return f"{M} rows: the last tile runs every row, up to {MAX_ROWS[epilogue]}", ()
    tma = interpreting(_fp8_gemm_epilogue_kernel) or capability(a.device) >= (9, 0)
    tiles, split, uses_tma, meta = _launch_plan(M, N, K, False, tma, tuple(sorted((config or {}).items())))
    if uses_tma:
        return "the TMA kernel's plan", ()
    count = counters(a.device, tiles + 1)
    if count is None:
        return "no tile counters (a package's trace, more tiles than counters, or FXQUANT_SPLIT_REDUCE=kernel)", ()
    # the fused kernel keeps the operands as given, as every default plan does (the plan is cached: not changed)
    return None, (tiles, split, {name: value for name, value in meta.items() if name != "SWAP_AB"}, count)


def _norm_plan(a, a_scale, b, b_scale, residual, group_size, config) -> tuple[str | None, tuple]:
    M, N = a.shape[0], b.shape[0]
    if residual.shape != (M, N) or residual.dtype not in TORCH_TO_TL:
        return f"a residual {tuple(residual.shape)} {residual.dtype} for a [{M}, {N}] product", ()
    reason = norm_supports(N, group_size)
    return (reason, ()) if reason else _plan(NORM, a, a_scale, b, b_scale, config)


def _silu_plan(a, a_scale, b, b_scale, out_dtype, config) -> tuple[str | None, tuple]:
    N = b.shape[0]
    if N % 2 or out_dtype not in TORCH_TO_TL:
        return f"a product of {N} columns in {out_dtype}: gate and up are its two halves, in a float dtype", ()
    reason = row_refusal(N // 2)
    return (reason, ()) if reason else _plan(SILU, a, a_scale, b, b_scale, config)


def refusal(a, a_scale, b, b_scale, residual, group_size, config=None) -> str | None:
    """Why the GEMM does not take the add, norm and quantizer (the two kernels run instead), or None."""
    return _norm_plan(a, a_scale, b, b_scale, residual, group_size, config)[0]


def silu_refusal(a, a_scale, b, b_scale, out_dtype, config=None) -> str | None:
    """Why the GEMM does not take SiLU x up and its per-token quantizer (the two kernels run instead), or None."""
    return _silu_plan(a, a_scale, b, b_scale, out_dtype, config)[0]


def _launch(epilogue, a, a_scale, b, b_scale, bias, residual, h, weight, norm_bias, codes, scales, eps, group, rms,
            block, plan):
    tiles, split, meta, count = plan
    M, K = a.shape
    N = b.shape[0]
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else h
    asm = 0 if a_scale.numel() == 1 else a_scale.reshape(-1).stride(0)
    bsn = 0 if b_scale.numel() == 1 else b_scale.reshape(-1).stride(0)
    visible(_fp8_gemm_epilogue_kernel)[(tiles, split)](
        a, b, ws, a_scale, b_scale, bias if bias is not None else h, count, residual, h,
        weight if weight is not None else h, norm_bias if norm_bias is not None else h, codes, scales,
        M, N, K, scales.shape[1], eps,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), asm, bsn,
        EPILOGUE=epilogue, HAS_BIAS=bias is not None, LP=TORCH_TO_TL[h.dtype],
        CAST=cast_mode(_fp8_gemm_epilogue_kernel, a.device), SPLIT_K=split, RMS=rms, HAS_W=weight is not None,
        HAS_B=norm_bias is not None, GROUP=group, FMAX=E4M3_MAX, FP8=tl.float8e4nv, AMAX_FLOOR=AMAX_FLOOR,
        BLOCK_D=block, **meta, **launch_options(a.device),
    )


def fused_add_norm_quant(a, a_scale, b, b_scale, bias, residual, weight, norm_bias, eps, group_size=0, *, rms=True,
                         config=None):
    """`fp8_scaled_mm_add_norm_quant`'s one kernel, or None where it does not take the operands (`refusal`): the
    caller then runs its own two kernels. residual: contiguous."""
    reason, plan = _norm_plan(a, a_scale, b, b_scale, residual, group_size, config)
    if reason is not None:
        return None
    M, N = a.shape[0], b.shape[0]
    block = next_power_of_2(N)
    codes = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=a.device)
    scales = torch.empty((M, N // group_size if group_size else 1), dtype=torch.float32, device=a.device)
    h = torch.empty_like(residual)
    _launch(NORM, a, a_scale, b, b_scale, bias, residual, h, weight, norm_bias, codes, scales, eps,
            group_size or block, rms, block, plan)
    return codes, scales, h


def fp8_scaled_mm_add_norm_quant(a, a_scale, b, b_scale, bias, residual, weight, norm_bias, eps, group_size=0, *,
                                 rms=True, config=None):
    """norm_quant_fp8(residual, weight, norm_bias, eps, group_size, rms=rms, residual=fp8_scaled_mm(a, a_scale, b,
    b_scale, bias, residual.dtype)) without its stats: (codes [M, N] e4m3, scales [M, N / g or 1] fp32, h [M, N]),
    h = residual + the product in residual's dtype. One kernel where `refusal` finds none, else the two."""
    residual = residual.contiguous()
    fused = fused_add_norm_quant(a, a_scale, b, b_scale, bias, residual, weight, norm_bias, eps, group_size, rms=rms,
                                 config=config)
    if fused is not None:
        return fused
    product = fp8_scaled_mm(a, a_scale, b, b_scale, bias, residual.dtype, config)
    codes, scales, h, _ = norm_quant_fp8(residual, weight, norm_bias, eps, group_size, rms=rms, residual=product)
    return codes, scales, h


def fused_silu_mul_quantize(a, a_scale, b, b_scale, bias, out_dtype=torch.bfloat16, *, config=None):
    """`fp8_scaled_mm_silu_mul_quantize`'s one kernel, or None where it does not take the operands (`silu_refusal`):
    the caller then runs its own two kernels."""
    reason, plan = _silu_plan(a, a_scale, b, b_scale, out_dtype, config)
    if reason is not None:
        return None
    M, N = a.shape[0], b.shape[0]
    codes = torch.empty((M, N // 2), dtype=torch.float8_e4m3fn, device=a.device)
    scales = torch.empty((M, 1), dtype=torch.float32, device=a.device)
    product = torch.empty((M, N), dtype=out_dtype, device=a.device)
    _launch(SILU, a, a_scale, b, b_scale, bias, product, product, None, None, codes, scales, 0.0, 1, True, SILU_CHUNK,
            plan)
    return codes, scales


def fp8_scaled_mm_silu_mul_quantize(a, a_scale, b, b_scale, bias, out_dtype=torch.bfloat16, *, config=None):
    """silu_mul_quantize_fp8_rows(gate, up, N / 2) of the product p = fp8_scaled_mm(a, a_scale, b, b_scale, bias,
    out_dtype) [M, N], gate = p[:, :N/2] and up = p[:, N/2:]: (codes [M, N/2] e4m3, scales [M, 1] fp32), per token.
    One kernel where `silu_refusal` finds none, else the two."""
    fused = fused_silu_mul_quantize(a, a_scale, b, b_scale, bias, out_dtype, config=config)
    if fused is not None:
        return fused
    product = fp8_scaled_mm(a, a_scale, b, b_scale, bias, out_dtype, config)
    width = product.shape[1] // 2
    return silu_mul_quantize_fp8_rows(product[:, :width], product[:, width:], width)
