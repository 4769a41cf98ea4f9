"""MXFP8 activations as the bf16 values they stand for: each block of 32 is quantized to e4m3 with its E8M0 scale
("floor" mode, the recipe's) and dequantized in the same pass, bit-exact with
`reference.dequantize(reference.quantize(x, "mxfp8"), torch.bfloat16)`.

bf16 holds an e4m3 code times a power-of-two scale exactly (4 significant bits, fp32's exponent range) down to
2^-133, so a product of these values with a decoded MXFP8 weight is the MX product: no MX tensor cores needed.
Only blocks whose scale is below 2^-124 (amax under 2^-116) can hold smaller values; those round to bf16, as the
reference's dequantize to bf16 rounds them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, cast_fp8, cast_mode, float_cast_mode
from fxquant.kernels.codes import E8M0_MIN
from fxquant.kernels.launch import cdiv, next_power_of_2, visible
from fxquant.kernels.quant_fp8 import max_keep_nan, saturate
from fxquant.numerics.formats import E4M3
from fxquant.numerics.reference import MX_BLOCK


@triton.jit
def _mxfp8_values_kernel(
    # pointers
    x_ptr, y_ptr,
    # sizes
    n_blocks,
    # meta-parameters
    FMAX: tl.constexpr, EMAX: tl.constexpr, CAST: tl.constexpr, FLOAT_CAST: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_PER_PROGRAM: tl.constexpr,
):
    blocks = tl.program_id(0) * BLOCKS_PER_PROGRAM + tl.arange(0, BLOCKS_PER_PROGRAM)
    offs = blocks[:, None].to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask = blocks[:, None] < n_blocks
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # [blocks, 32]: the reference's fp32 math
    amax = tl.reduce(tl.abs(x), 1, max_keep_nan)  # NaN or inf anywhere in a block surfaces here
    # "floor": floor(log2(amax)) - emax of e4m3, read off amax's exponent bits; clamped to E8M0's range, so a
    # zero or tiny block gets 2^-127 (fp32's one subnormal power of two here), never a zero scale.
    e = tl.minimum(tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - EMAX, -127), 127)
    scale = tl.where(e == -127, E8M0_MIN, ((e + 127) << 23).to(tl.float32, bitcast=True))
    scale = tl.where(amax < float("inf"), scale, float("nan"))  # a poisoned block: every value NaN
    q = saturate(x * tl.math.div_rn(1.0, scale)[:, None], FMAX)  # powers of two: the multiply is exact
    q = tl.where(tl.abs(x) < float("inf"), q, float("nan"))  # inf is poison: NaN, never saturated to max
    values = cast_fp8(q, tl.float8e4nv, CAST).to(tl.float32) * scale[:, None]  # exact: a code times 2^e
    tl.store(y_ptr + offs, cast_float(values, tl.bfloat16, FLOAT_CAST), mask=mask)


@functools.lru_cache(maxsize=256)
def _plan(n_blocks: int) -> tuple[int, int]:
    """(programs, blocks per program): 8K elements per program, fewer for a small input."""
    per_program = min(256, max(1, next_power_of_2(n_blocks)))
    return cdiv(n_blocks, per_program), per_program


def mxfp8_values(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16/fp16/fp32 with K a multiple of 32 -> bf16 [..., K]: each value quantized to MXFP8 (blocks
    of 32 along K) and dequantized."""
    if x.shape[-1] % MX_BLOCK:
        raise ValueError(f"fxquant: MXFP8 needs the last dim to be a multiple of {MX_BLOCK}, got {x.shape[-1]}")
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    n_blocks = x.numel() // MX_BLOCK
    if n_blocks:
        programs, per_program = _plan(n_blocks)
        visible(_mxfp8_values_kernel)[(programs,)](
            x, y, n_blocks, FMAX=E4M3.max, EMAX=E4M3.emax, CAST=cast_mode(_mxfp8_values_kernel, x.device),
            FLOAT_CAST=float_cast_mode(_mxfp8_values_kernel), BLOCK=MX_BLOCK, BLOCKS_PER_PROGRAM=per_program,
            num_warps=8 if per_program == 256 else 4,
        )
    return y
