"""The rows of a grouped product past the last expert's end, which no expert owns, zeroed on the device.

torch's grouped GEMMs (`torch._grouped_mm`, `torch._scaled_grouped_mm`) allocate their output empty and never write
those rows; fxquant's grouped products give them as zero. This kernel reads offs[-1] on the device (no host sync, so
a CUDA graph replays it) and stores only where a program's rows fall past it: with every row owned, as in an MoE
layer's forward, it reads one offset a program and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.launch import cdiv, visible

ZERO_ROWS, ZERO_COLUMNS = 32, 256  # a program's block of the rows it may zero, and its column step


@triton.jit
def _zero_unowned_rows_kernel(out_ptr, offs_ptr, M, N, stride_om, E: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                              BLOCK_COLUMNS: tl.constexpr):
    """Zeroes out's rows from offs[E - 1] (the last expert's end) to M; a program whose rows all belong to experts
    stores nothing."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    unowned = (rows >= tl.load(offs_ptr + E - 1)) & (rows < M)
    columns = tl.arange(0, BLOCK_COLUMNS)
    zeros = tl.zeros((BLOCK_ROWS, BLOCK_COLUMNS), dtype=out_ptr.dtype.element_ty)
    for start in range(0, N, BLOCK_COLUMNS):
        mask = unowned[:, None] & (start + columns[None, :] < N)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + start + columns[None, :], zeros, mask=mask)


def zero_unowned_rows(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out [M, N] (unit column stride) with its rows past offs[-1] zeroed in place, offs read on the device."""
    M, N = out.shape
    visible(_zero_unowned_rows_kernel)[(cdiv(M, ZERO_ROWS),)](
        out, offs, M, N, out.stride(0), E=offs.shape[0], BLOCK_ROWS=ZERO_ROWS, BLOCK_COLUMNS=ZERO_COLUMNS)
    return out
