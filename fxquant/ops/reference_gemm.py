"""The reference GEMM every op falls back to where no kernel serves: fp32 operands and accumulation over bounded
tiles, one cast to the output dtype."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from fxquant.numerics import reference as R
from fxquant.numerics.granularity import Granularity
from fxquant.numerics.quantized import Quantized

E4M3 = torch.float8_e4m3fn
# Rows of x, and of a weight, taken to fp32 at a time by the reference GEMMs: temporaries stay bounded at any M
# and no fp32 copy of a whole weight is ever made. A multiple of every scale block (16, 32, 128).
CHUNK_ROWS = 2048


def rows_of(q: Quantized, start: int, stop: int) -> Quantized:
    """Rows [start, stop) of a 2-D Quantized; start and stop are multiples of its block rows."""
    def cut(t):
        if t is None or t.numel() == 1:
            return t
        block_rows = q.granularity.sizes[0] if q.granularity.kind == "block" else 1
        return t[start // block_rows: -(-stop // block_rows)]

    shape = torch.Size((stop - start, *q.shape[1:]))
    return replace(q, data=q.data[start:stop], scale=cut(q.scale), zero_point=cut(q.zero_point), shape=shape)


def chunked_linear(x: Quantized | Tensor, qw: Quantized, bias: Tensor | None, out_dtype: torch.dtype,
                    x_fp32=None) -> Tensor:
    """x [M, K] @ dequantize(qw).T + bias with fp32 operands and accumulation and one cast to out_dtype, in
    CHUNK_ROWS x CHUNK_ROWS output tiles. x is a Quantized (dequantized per tile) or a tensor, which x_fp32
    (rows -> fp32 rows) may requantize first."""
    m, n = x.shape[0], qw.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=qw.data.device)
    for n0 in range(0, n, CHUNK_ROWS):
        n1 = min(n, n0 + CHUNK_ROWS)
        w = R.dequantize(rows_of(qw, n0, n1), torch.float32)  # [n1 - n0, K]
        for m0 in range(0, m, CHUNK_ROWS):
            m1 = min(m, m0 + CHUNK_ROWS)
            if isinstance(x, Quantized):
                rows = R.dequantize(rows_of(x, m0, m1), torch.float32)
            else:
                rows = x_fp32(x[m0:m1]) if x_fp32 else x[m0:m1].float()
            # Row-major rows: the CPU BLAS sums in an order set by the operand's layout (a transposed input gave
            # other bits on the H200 host's 16 threads), and an input's strides must not change the result.
            acc = rows.contiguous() @ w.T
            if bias is not None:
                acc += bias[n0:n1].float()
            out[m0:m1, n0:n1] = acc  # the one narrowing cast
    return out


def weight_granularity(w: Tensor, w_scale: Tensor) -> Granularity:
    if w_scale.numel() == 1:
        return Granularity("tensor")
    if w_scale.shape[0] == w.shape[0]:
        return Granularity("channel")
    return Granularity("block", (w.shape[0] // w_scale.shape[0], w.shape[1] // w_scale.shape[1]))
