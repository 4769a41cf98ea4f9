"""silu(gate) * up quantized to fp8 in rows, in one launch: a gated MLP's activation before its down projection.

The product is computed in fp32 and rounded once to the activations' dtype, the tensor the unfused graph stores;
its rows are then quantized as `quant_fp8.quantize_fp8_rows` quantizes them, bit for bit.

One program takes whole rows, at decode a token's row of 14336 on one SM. Cutting a few tokens' rows across
programs (2048 columns each, the token's last program to count in quantizing the row) was built and timed: 3.85 /
4.49 us at 1 / 16 tokens against 3.91 / 4.46 for one program a row, and slower from 32 tokens (H100, BENCHMARKS.md:
"The int4 decode GEMM over several warps a program, the gated MLP's quantizer cut, the FP4 GEMMs per shape, and the
suite, on the H100"), so it was taken out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import visible
from fxquant.kernels.quant_fp8 import FLOAT_TYPES, FP8_FORMATS, MAX_ROW_LEN, quant_rows, rows_plan


@triton.jit
def silu_mul(gate, up, OUT: tl.constexpr, CAST: tl.constexpr):
    """silu(gate) * up in fp32 (silu as gate * sigmoid(gate)), rounded once to OUT, returned in fp32."""
    return cast_float(gate * tl.sigmoid(gate) * up, OUT, CAST).to(tl.float32)


@triton.jit
def _silu_mul_quant_fp8_kernel(
    # pointers
    gate_ptr, up_ptr, y_ptr, scale_ptr,
    # sizes and the inputs' token strides
    n_rows, row_len, width, stride_gate, stride_up,
    # meta-parameters
    OUT: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, PDL: tl.constexpr,
):
    """Quantizer rows of silu(gate) * up: row r is chunk r % (width / row_len) of token r // (width / row_len)."""
    wait_for_previous(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < row_len)
    chunks = width // row_len
    token, column = rows // chunks, (rows % chunks) * row_len
    gate = tl.load(gate_ptr + token[:, None].to(tl.int64) * stride_gate + column[:, None] + cols[None, :], mask=mask,
                   other=0.0).to(tl.float32)
    up = tl.load(up_ptr + token[:, None].to(tl.int64) * stride_up + column[:, None] + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)
    codes, scale = quant_rows(silu_mul(gate, up, OUT, CAST), FMAX, FP8, CAST, AMAX_FLOOR)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * row_len + cols[None, :], codes, mask=mask)
    tl.store(scale_ptr + rows, scale, mask=rows < n_rows)


def silu_mul_quantize_fp8_rows(gate: torch.Tensor, up: torch.Tensor, row_len: int,
                               fp8_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows(silu(gate) * up) in one launch, the product rounded once to gate's dtype as the unfused graph
    stores it. gate, up: [..., I] of one dtype, each token's row contiguous (slices of a merged gate/up output
    qualify); -> (codes [..., I], scales [..., I // row_len])."""
    width = gate.shape[-1]
    if (gate.shape != up.shape or gate.dtype != up.dtype or width % row_len or row_len > MAX_ROW_LEN
            or fp8_dtype not in FP8_FORMATS):
        raise ValueError(f"fxquant: silu(gate) * up quantized in rows of {row_len} needs gate and up of one shape and "
                         f"dtype whose last dim it divides (at most {MAX_ROW_LEN}), and an fp8 dtype; got "
                         f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype} into {fp8_dtype}")
    gate2, up2 = (t.reshape(-1, width) if t.stride(-1) == 1 else t.contiguous().reshape(-1, width) for t in (gate, up))
    y = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    scale = torch.empty((*gate.shape[:-1], width // row_len), dtype=torch.float32, device=gate.device)
    n_rows = gate2.shape[0] * (width // row_len)
    if n_rows:
        programs, meta = rows_plan(n_rows, row_len, fp8_dtype)
        visible(_silu_mul_quant_fp8_kernel)[(programs,)](
            gate2, up2, y, scale, n_rows, row_len, width, gate2.stride(0), up2.stride(0), OUT=FLOAT_TYPES[gate.dtype],
            CAST=cast_mode(_silu_mul_quant_fp8_kernel, gate.device), **meta, **launch_options(gate.device),
        )
    return y, scale
