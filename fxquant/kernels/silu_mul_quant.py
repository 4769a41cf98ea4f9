"""silu(gate) * up quantized to fp8 in rows, in one launch: a gated MLP's activation before its down projection.

The product is computed in fp32 and rounded once to the activations' dtype, the tensor the unfused graph stores;
its rows are then quantized as `quant_fp8.quantize_fp8_rows` quantizes them, bit for bit.

One program takes whole rows. A few tokens quantized per token (decode: one row of 14336 per token) leave one
program, on one SM, to compute every sigmoid of its row. Under `rows_cut_up_to`, each such token's row is cut into
chunks of SPLIT_CHUNK columns, one program each: a program stores its chunk's product and amax, and the token's
last program to count in (`splitk.counters`, as split-K GEMMs count) takes the amax of all its chunks, the scale, and
quantizes the row from the stored products. The codes and scales are the one-program kernel's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, cast_mode
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.launch import cdiv, next_power_of_2, set_inside, visible
from fxquant.kernels.quant_fp8 import (
    FLOAT_TYPES,
    FP8_FORMATS,
    MAX_ROW_LEN,
    codes_of,
    max_keep_nan,
    quant_rows,
    row_scale,
    rows_plan,
)
from fxquant.kernels.splitk import counters
from fxquant.numerics.formats import AMAX_FLOOR

SPLIT_CHUNK = 2048  # columns of a token's row per program where its row is cut
# The most tokens whose rows are cut, unless `rows_cut_up_to` says otherwise: none until the 32-layer step has timed
# it (`python -m bench.decode fxquant:fp8_row+cutrows fxquant:fp8_row ...`); 16 is the candidate timed
CUT_TOKENS = 16
_split_up_to = [0]


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


@triton.jit
def _silu_mul_quant_fp8_cut_kernel(
    # pointers: h [tokens, width] and amax [tokens, CHUNKS] hold each chunk's product and amax
    gate_ptr, up_ptr, h_ptr, amax_ptr, counter_ptr, y_ptr, scale_ptr,
    # sizes and the inputs' token strides
    width, stride_gate, stride_up,
    # meta-parameters
    OUT: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr, CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    CHUNKS: tl.constexpr, PARTS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, chunk): the product of columns chunk * CHUNK ... and their amax; the token's last program to
    count in quantizes its whole row with one scale per token."""
    wait_for_previous(PDL)
    token, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = cols < width
    gate = tl.load(gate_ptr + token * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + token * stride_up + cols, mask=mask, other=0.0).to(tl.float32)
    h = silu_mul(gate, up, OUT, CAST)  # 0 past the row: no amax moves
    tl.store(h_ptr + token * width + cols, h.to(OUT), mask=mask)  # exact: h is already rounded to OUT
    tl.store(amax_ptr + token * CHUNKS + chunk, tl.reduce(tl.abs(h), 0, max_keep_nan))
    tl.debug_barrier()  # every thread's product is stored before the count releases it
    done = tl.atomic_add(counter_ptr + token, 1, sem="acq_rel", scope="gpu")
    if done == CHUNKS - 1:
        parts = tl.arange(0, PARTS)  # CHUNKS rounded up to a power of two; read through L2 (.cg): other SMs wrote
        amax = tl.reduce(tl.load(amax_ptr + token * CHUNKS + parts, mask=parts < CHUNKS, other=0.0,
                                 cache_modifier=".cg"), 0, max_keep_nan)
        scale = row_scale(amax, FMAX, AMAX_FLOOR)
        inverse = tl.math.div_rn(1.0, scale)
        for c in tl.static_range(CHUNKS):  # unrolled: every chunk's load in flight at once
            row = c * CHUNK + tl.arange(0, CHUNK)
            stored = tl.load(h_ptr + token * width + row, mask=row < width, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + token * width + row, codes_of(stored.to(tl.float32), inverse, FMAX, FP8, CAST),
                     mask=row < width)
        tl.store(scale_ptr + token, scale)
        tl.store(counter_ptr + token, 0)  # the next kernel to count waits for this one to end


def rows_cut_up_to(tokens: int):
    """Inside the block, up to `tokens` tokens quantized per token have their rows cut across programs (0: one
    program a row, the default)."""
    return set_inside(_split_up_to, tokens)


def chunks_of(tokens: int, row_len: int, width: int) -> int:
    """The programs each token's row is cut into: 1 (one program a row) unless the rows are per token, the tokens
    within `rows_cut_up_to` and the row longer than a chunk."""
    if row_len != width or not 0 < tokens <= _split_up_to[0]:
        return 1
    return cdiv(width, SPLIT_CHUNK)


def silu_mul_quantize_fp8_rows(gate: torch.Tensor, up: torch.Tensor, row_len: int,
                               fp8_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows(silu(gate) * up) in one launch, the product rounded once to gate's dtype as the unfused graph
    stores it. gate, up: [..., I] of one dtype, each token's row contiguous (slices of a merged gate/up output
    qualify); -> (codes [..., I], scales [..., I // row_len])."""
    fmt, tl_fp8 = FP8_FORMATS[fp8_dtype]
    width = gate.shape[-1]
    if gate.shape != up.shape or gate.dtype != up.dtype or width % row_len or row_len > MAX_ROW_LEN:
        raise ValueError(f"fxquant: silu(gate) * up quantized in rows of {row_len} needs gate and up of one shape and "
                         f"dtype whose last dim it divides (at most {MAX_ROW_LEN}); got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    gate2, up2 = (t.reshape(-1, width) if t.stride(-1) == 1 else t.contiguous().reshape(-1, width) for t in (gate, up))
    tokens = gate2.shape[0]
    y = torch.empty(gate.shape, dtype=fp8_dtype, device=gate.device)
    scale = torch.empty((*gate.shape[:-1], width // row_len), dtype=torch.float32, device=gate.device)
    chunks = chunks_of(tokens, row_len, width)
    count = counters(gate.device, tokens) if chunks > 1 else None
    if count is not None:
        h = torch.empty((tokens, width), dtype=gate.dtype, device=gate.device)
        amax = torch.empty((tokens, chunks), dtype=torch.float32, device=gate.device)
        visible(_silu_mul_quant_fp8_cut_kernel)[(tokens, chunks)](
            gate2, up2, h, amax, count, y, scale, width, gate2.stride(0), up2.stride(0), OUT=FLOAT_TYPES[gate.dtype],
            FMAX=fmt.max, FP8=tl_fp8, CAST=cast_mode(_silu_mul_quant_fp8_cut_kernel, gate.device),
            AMAX_FLOOR=AMAX_FLOOR, CHUNKS=chunks, PARTS=next_power_of_2(chunks), CHUNK=SPLIT_CHUNK, num_warps=8,
            **launch_options(gate.device))
        return y, scale
    n_rows = tokens * (width // row_len)
    if n_rows:
        programs, meta = rows_plan(n_rows, row_len, fp8_dtype)
        visible(_silu_mul_quant_fp8_kernel)[(programs,)](
            gate2, up2, y, scale, n_rows, row_len, width, gate2.stride(0), up2.stride(0), OUT=FLOAT_TYPES[gate.dtype],
            CAST=cast_mode(_silu_mul_quant_fp8_kernel, gate.device), **meta, **launch_options(gate.device),
        )
    return y, scale
