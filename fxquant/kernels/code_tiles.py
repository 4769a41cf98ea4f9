"""Packed 4-bit codes (int4; MXFP4 and NVFP4 under the option fp4_lanes) in tiles: a layout of a weight's codes
in which each decode program's K step reads one contiguous run of memory.

A weight's codes as `quantize` packs them are rows [N, K / 2] bytes: a K step of 128 codes over 64 rows reads 64 B
from each of 64 rows, K / 2 bytes apart. Tiled, they are [N / 64, K / 128, 64, 64] bytes: tile (i, j) holds codes
128 j .. 128 j + 127 of rows 64 i .. 64 i + 63, row after row in their stored order, so that step is 4 KB in one
run. The int4 decode kernel's loads alone took 79-88% of its time with the codes as stored, and tiled the kernel ran
6-18% faster on the Llama shapes at M = 1 (H100, BENCHMARKS.md, "The int4 decode GEMM's launch, split and code
layout").

`tile_codes` and `untile_codes` are the one conversion each way; `tiled_words` addresses tiles from a kernel, and
`step_tile` finds the tile a program of 64 rows reads in one K step (its rows then 16 words apart).
Tiles need N a multiple of 64 and K of 128 (`tiles_fit`), so that a merged weight is its parts' tiles stacked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ROWS = 64  # rows of a tile: the mma.sync decode kernels' rows per program
TILE_CODES = 128  # codes of a row in a tile: one K step of that kernel, and a multiple of its int4 groups


def tiles_fit(N: int, K: int) -> bool:
    """Whether the codes of an [N, K] 4-bit weight can be tiled."""
    return N > 0 and K > 0 and N % TILE_ROWS == 0 and K % TILE_CODES == 0


def is_tiled(codes: torch.Tensor) -> bool:
    """Whether packed 4-bit codes are tiles (4-D) rather than rows (2-D)."""
    return codes.dim() == 4


def code_rows(codes: torch.Tensor) -> int:
    """The weight rows (N) that packed 4-bit codes hold, as rows or as tiles."""
    return codes.shape[0] * TILE_ROWS if is_tiled(codes) else codes.shape[0]


def tiled_shape(N: int, K: int) -> tuple[int, int, int, int]:
    """The tiles' shape, in bytes, for an [N, K] 4-bit weight."""
    return N // TILE_ROWS, K // TILE_CODES, TILE_ROWS, TILE_CODES // 2


def tile_codes(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes [N, K / 2] (uint8, as `quantize` packs them) as tiles [N / 64, K / 128, 64, 64]."""
    N, half_k = codes.shape
    if not tiles_fit(N, 2 * half_k):
        raise ValueError(f"fxquant: the 4-bit codes of a [{N}, {2 * half_k}] weight do not tile: tiles need N a "
                         f"multiple of {TILE_ROWS} and K of {TILE_CODES}")
    tiles, k_tiles, rows, tile_bytes = tiled_shape(N, 2 * half_k)
    return codes.reshape(tiles, rows, k_tiles, tile_bytes).permute(0, 2, 1, 3).contiguous()


def untile_codes(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles [N / 64, K / 128, 64, 64] as the packed codes [N, K / 2] they hold."""
    row_tiles, k_tiles, rows, tile_bytes = tiles.shape
    return tiles.permute(0, 2, 1, 3).reshape(row_tiles * rows, k_tiles * tile_bytes)


@triton.jit
def tiled_words(rows, words, K):
    """Offsets, in int32 words of 8 codes, of words `words` (K / 8 of them a row) of rows `rows` in the tiles of a
    weight K codes wide; rows and words broadcast together. A row's part and a word's part are summed last, so that a
    loop over K steps keeps the rows' part. The literals are TILE_ROWS (64) and TILE_CODES / 8 (16 words a tile row):
    Triton reads no plain globals."""
    row_part = (rows // 64).to(tl.int64) * (K // 128) * 1024 + (rows % 64) * 16
    return row_part + (words // 16) * 1024 + words % 16


@triton.jit
def step_tile(w_ptr, row_tile, step, K):
    """The first word of tile (row_tile, step) of a weight K codes wide: rows 64 row_tile .. 64 row_tile + 63 of
    codes 128 step .. 128 step + 127, 16 words a row (the literals as in `tiled_words`)."""
    return w_ptr + (row_tile.to(tl.int64) * (K // 128) + step) * 1024
