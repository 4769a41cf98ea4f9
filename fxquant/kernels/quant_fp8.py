"""FP8 activation quantization: dynamic per-row scales (per token, or per 1xg group), and per tensor, static or
dynamic.

A 1xg group quantizer is the per-row quantizer on the [M*K/g, g] view of a contiguous input, so both
granularities share `_quant_fp8_rows_kernel`. Numerics match `fxquant.numerics.reference` bit for bit: fp32 math,
one IEEE reciprocal per row then multiplies, the amax floor, NaN/inf poison, saturation, and the shared cast helper.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_fp8, cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import cdiv, next_power_of_2, visible
from fxquant.numerics.formats import AMAX_FLOOR, E4M3, E5M2

FP8_FORMATS = {torch.float8_e4m3fn: (E4M3, tl.float8e4nv), torch.float8_e5m2: (E5M2, tl.float8e5)}
FLOAT_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
MAX_ROW_LEN = 16384  # one row lives in registers; longer rows go to the reference
# Dynamic per-tensor: the amax pass runs at most this many programs, each striding over the tensor, so that every
# program of the quantize pass can reduce all their partials itself.
MAX_AMAX_PROGRAMS = 512
TENSOR_BLOCK = 4096


@triton.jit
def max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def saturate(q, FMAX: tl.constexpr):
    # Clamp to +-FMAX with NaN-propagating min/max: a poisoned value must stay NaN, never become +-FMAX.
    return tl.minimum(tl.maximum(q, -FMAX, propagate_nan=tl.PropagateNan.ALL), FMAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quant_fp8_rows_kernel(
    # pointers
    x_ptr, y_ptr, scale_ptr,
    # sizes
    n_rows, row_len,
    # meta-parameters
    FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < row_len)
    offs = rows[:, None].to(tl.int64) * row_len + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # x: [BLOCK_ROWS, BLOCK_COLS]
    codes, scale = quant_rows(x, FMAX, FP8, CAST, AMAX_FLOOR)
    tl.store(y_ptr + offs, codes, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < n_rows)


@triton.jit
def quant_rows(x, FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """fp32 x [R, C] -> (fp8 codes [R, C], fp32 scales [R]): one dynamic scale per row, as the reference makes it."""
    amax = tl.reduce(tl.abs(x), 1, max_keep_nan)  # NaN or inf anywhere in a row surfaces here
    # Same fp32 ops as the reference: max(amax, floor) / FMAX (IEEE division); a poisoned row gets a NaN
    # scale, so every code in it is NaN.
    scale = tl.where(amax < float("inf"), tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FMAX), float("nan"))
    q = saturate(x * tl.math.div_rn(1.0, scale)[:, None], FMAX)
    return cast_fp8(q, FP8, CAST), scale


@triton.jit
def _quant_fp8_static_kernel(
    # pointers
    x_ptr, y_ptr, scale_ptr,
    # sizes
    n,
    # meta-parameters
    FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = saturate(x * tl.math.div_rn(1.0, tl.load(scale_ptr)), FMAX)
    q = tl.where(tl.abs(x) < float("inf"), q, float("nan"))  # inf is poison: NaN, never saturated to max
    tl.store(y_ptr + offs, cast_fp8(q, FP8, CAST), mask=mask)


@triton.jit
def _partial_amax_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    """partial[p] = max |x| over blocks p, p + P, p + 2P, ... (P programs); NaN and inf survive."""
    programs = tl.num_programs(0)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        amax = max_keep_nan(amax, tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)))
    tl.store(partial_ptr + tl.program_id(0), tl.reduce(amax, 0, max_keep_nan))


@triton.jit
def _quant_fp8_tensor_kernel(
    # pointers
    x_ptr, y_ptr, partial_ptr, scale_ptr,
    # sizes
    n, n_partials,
    # meta-parameters
    FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    BLOCK: tl.constexpr, PARTIALS: tl.constexpr,
):
    """Every program reduces the partial amaxes itself (a few KB from L2) rather than wait on another launch."""
    parts = tl.arange(0, PARTIALS)
    amax = tl.reduce(tl.load(partial_ptr + parts, mask=parts < n_partials, other=0.0), 0, max_keep_nan)
    # The reference's fp32 ops: max(amax, floor) / FMAX (IEEE division); NaN or inf anywhere gives a NaN scale.
    scale = tl.where(amax < float("inf"), tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), FMAX), float("nan"))
    if tl.program_id(0) == 0:
        tl.store(scale_ptr, scale)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = saturate(x * tl.math.div_rn(1.0, scale), FMAX)
    q = tl.where(tl.abs(x) < float("inf"), q, float("nan"))  # inf is poison: NaN, never saturated to max
    tl.store(y_ptr + offs, cast_fp8(q, FP8, CAST), mask=mask)


@functools.lru_cache(maxsize=1024)
def rows_plan(n_rows: int, row_len: int, fp8_dtype: torch.dtype) -> tuple[int, dict]:
    """(programs, meta-parameters): a whole row per tile, about 8K elements per program. The same for every call
    at a shape, so worked out once."""
    fmt, tl_fp8 = FP8_FORMATS[fp8_dtype]
    block_cols = next_power_of_2(row_len)
    block_rows = max(1, min(next_power_of_2(max(n_rows, 1)), 8192 // block_cols))
    return cdiv(n_rows, block_rows), dict(FMAX=fmt.max, FP8=tl_fp8, AMAX_FLOOR=AMAX_FLOOR, BLOCK_ROWS=block_rows,
                                          BLOCK_COLS=block_cols, num_warps=4 if block_rows * block_cols <= 4096 else 8)


def supports_rows(x: torch.Tensor, row_len: int) -> str | None:
    """Why quantize_fp8_rows cannot quantize x in rows of row_len, or None where it can."""
    if not x.is_cuda:
        return "it runs on CUDA devices (the CPU takes the reference)"
    return row_refusal(row_len)


def row_refusal(row_len: int) -> str | None:
    """What in the rows alone keeps quantize_fp8_rows from quantizing them on a GPU, or None."""
    if row_len > MAX_ROW_LEN:
        return f"a row lives in registers: {row_len} elements is past its {MAX_ROW_LEN}"
    return None


def quantize_fp8_rows(x: torch.Tensor, row_len: int, fp8_dtype=torch.float8_e4m3fn):
    """Dynamic fp8 with one scale per `row_len` contiguous elements of the last dim.

    x: [..., K] with K % row_len == 0 -> (codes [..., K] fp8, scales [..., K // row_len] fp32)
    """
    if fp8_dtype not in FP8_FORMATS or x.shape[-1] % row_len or row_len > MAX_ROW_LEN:
        raise ValueError(f"fxquant: fp8 row quantizer needs an fp8 dtype and row_len <= {MAX_ROW_LEN} dividing "
                         f"K={x.shape[-1]}; got {fp8_dtype} and row_len {row_len}")
    x = x.contiguous()
    n_rows = x.numel() // row_len
    y = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // row_len), dtype=torch.float32, device=x.device)
    if n_rows:
        programs, meta = rows_plan(n_rows, row_len, fp8_dtype)
        visible(_quant_fp8_rows_kernel)[(programs,)](
            x, y, scale, n_rows, row_len, CAST=cast_mode(_quant_fp8_rows_kernel, x.device), **meta,
            **launch_options(x.device),
        )
    return y, scale


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor, fp8_dtype=torch.float8_e4m3fn) -> torch.Tensor:
    """Static per-tensor fp8: x / scale, saturated, cast. scale: one-element fp32 tensor on x's device."""
    fmt, tl_fp8 = FP8_FORMATS[fp8_dtype]
    if scale.numel() != 1:
        raise ValueError(f"fxquant: a static per-tensor scale has one element, got shape {tuple(scale.shape)}")
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    if x.numel():
        block = 4096
        visible(_quant_fp8_static_kernel)[(cdiv(x.numel(), block),)](
            x, y, scale.to(device=x.device, dtype=torch.float32).reshape(1), x.numel(),
            FMAX=fmt.max, FP8=tl_fp8, CAST=cast_mode(_quant_fp8_static_kernel, x.device), BLOCK=block,
            num_warps=8,
        )
    return y


def quantize_fp8_tensor(x: torch.Tensor, fp8_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-tensor fp8 in two launches (amax partials, then scale and codes): -> (codes shaped as x, fp32
    scale of shape [])."""
    fmt, tl_fp8 = FP8_FORMATS[fp8_dtype]
    x = x.contiguous()
    n = x.numel()
    y = torch.empty(x.shape, dtype=fp8_dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    n_partials = max(1, min(MAX_AMAX_PROGRAMS, cdiv(n, TENSOR_BLOCK)))
    partial = torch.empty(n_partials, dtype=torch.float32, device=x.device)
    visible(_partial_amax_kernel)[(n_partials,)](x, partial, n, BLOCK=TENSOR_BLOCK, num_warps=8)
    visible(_quant_fp8_tensor_kernel)[(max(1, cdiv(n, TENSOR_BLOCK)),)](
        x, y, partial, scale, n, n_partials, FMAX=fmt.max, FP8=tl_fp8,
        CAST=cast_mode(_quant_fp8_tensor_kernel, x.device), AMAX_FLOOR=AMAX_FLOOR, BLOCK=TENSOR_BLOCK,
        PARTIALS=next_power_of_2(n_partials), num_warps=8,
    )
    return y, scale
