"""One warp's operands of `mma.sync.m16n8k16` for the 4-bit decode GEMMs (`gemm_int4_mma`, `gemm_fp4_mma`): the
weights are the A operand (16 rows a block), the activations the B operand (up to 8 rows of A as its columns).
Lane (g, t) = (lane / 4, lane % 4) holds A rows g and g + 8 of a block and B column g.

Both kernels map K onto the MMA's 16 slots the same way, so that a lane reads its codes in stored order: in each
128-long K step, lane t takes codes 32t .. 32t + 31 of its rows, four int32 words in one 16-byte load per row. Word u
(codes 8u + j) feeds MMAs 2u and 2u + 1: one 32-bit register holds codes j and j + 4, 16 bits apart, which one
decode takes together. MMA 2u + e takes codes (2e, 2e + 4) into K slots (2t, 2t + 1) and (2e + 1, 2e + 5) into slots
(2t + 8, 2t + 9). The activations are paired the same way from the lane's own 32 values (`activation_pairs`).

Every asm operand is [32], element i in lane i: Triton 3.6 spread lanes across the first dimension of [4, 32]
operands, which mma.sync cannot take."""

from __future__ import annotations

import triton
import triton.language as tl

from fxquant.kernels.code_tiles import step_tile

BLOCKS = 4  # 16-row MMA blocks of a program's 64 rows


def mma_order() -> list[tuple[int, int]]:
    """The (block, MMA) pairs of a K step in the order the int4 kernel's PTX writes them: MMA c of every block before
    MMA c + 1 of any, four independent chains that ptxas overlaps two at a time (`python -m bench.sass mma`: at most
    3 MMAs in a row into one register). Written block after block, the four chains compiled to runs of 8 one after
    another; the two orders timed alike in the 32-layer chain (H100: 2.052 against 2.058 ms; BENCHMARKS.md,
    "Inductor's kernels launched dependent, the int4 MMA order and a last K step read before the wait"). The FP4
    kernel carries its blocks' accumulators across K steps in four statements, which ptxas already interleaves."""
    return [(b, c) for c in range(8) for b in range(BLOCKS)]


def mma_line(dtype: str, a: str, b: str, acc: str, out: str = "$0, $1, $2, $3") -> str:
    """One m16n8k16 MMA (fp32 accumulators) into `out` ($0-$3 unless given), from A registers `a`, B registers `b`
    and C `acc`."""
    return f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 {{{out}}}, {{{a}}}, {{{b}}}, {{{acc}}};"


@triton.jit
def columns(x):
    """x [32, 4] as its four [32] columns."""
    even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # x[:, 0::2], x[:, 1::2]
    x0, x2 = tl.split(even)
    x1, x3 = tl.split(odd)
    return x0, x1, x2, x3


@triton.jit
def stack(x0, x1, x2, x3):
    """Four [32] tensors as the columns of one [32, 4]."""
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (x0.shape[0], 4))


@triton.jit
def activation_pairs(ptr, mask):
    """The B registers of MMAs 2u and 2u + 1 from the 4 words (8 values) at ptr: (values 0, 4) and (1, 5) for the
    first, (2, 6) and (3, 7) for the second, matching the codes one decode takes from a word."""
    w0, w1, w2, w3 = columns(tl.load(ptr[:, None] + tl.arange(0, 4)[None, :], mask=mask, other=0))
    return ((w0 & 0xFFFF) | (w2 << 16), ((w0 >> 16) & 0xFFFF) | (w2 & -65536),
            (w1 & 0xFFFF) | (w3 << 16), ((w1 >> 16) & 0xFFFF) | (w3 & -65536))


@triton.jit
def block_words(w_ptr, row0, stride_w, t, step, N, TILED: tl.constexpr):
    """The [32, 4] words of one K step that lane (g, t) decodes for rows row0 (g) and row0 + 8 of a 16-row block:
    codes 32t .. 32t + 31 of the step. TILED: w_ptr is the step's tile (`code_tiles`) and row0 a row of it, all
    there, 16 words a row; else rows of stride_w words, rows past N read as 0."""
    word = tl.arange(0, 4)[None, :]
    row1 = row0 + 8
    if TILED:  # no mask, and no address that depends on the step
        w0 = tl.load(w_ptr + row0[:, None] * 16 + t[:, None] * 4 + word)
        w1 = tl.load(w_ptr + row1[:, None] * 16 + t[:, None] * 4 + word)
    else:
        w0 = tl.load(w_ptr + row0[:, None].to(tl.int64) * stride_w + t[:, None] * 4 + step * 16 + word,
                     mask=(row0 < N)[:, None], other=0)
        w1 = tl.load(w_ptr + row1[:, None].to(tl.int64) * stride_w + t[:, None] * 4 + step * 16 + word,
                     mask=(row1 < N)[:, None], other=0)
    return w0, w1


@triton.jit
def warp_plan(a_ptr, stride_am, M, K, SPLIT_K: tl.constexpr):
    """What one program (a warp over 64 weight rows, one K slice) works from: lane (g, t); its tile; rows0 [32, 4]
    (row g of each 16-row block; row g + 8 follows: rows1); the lane's activations of step 0 (a_row, 16 words of
    value pairs, masked by a_in past M); the K steps of the matrix and the slice's [first, last)."""
    lane = tl.arange(0, 32)
    g = lane // 4
    t = lane % 4
    tile = tl.program_id(0)
    rows0 = (tile * 64 + g)[:, None] + tl.arange(0, 4)[None, :] * 16
    a_row = a_ptr + g * stride_am + t * 16
    a_in = (g < M)[:, None]
    steps = K // 128
    per_slice = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(1) * per_slice
    return g, t, tile, rows0, rows0 + 8, a_row, a_in, steps, first, tl.minimum(first + per_slice, steps)


@triton.jit
def store_partials(ws_ptr, stride_ws, acc0, acc1, acc2, acc3, t, rows0, rows1, M, N):
    """The warp's fp32 C fragments [32, 4] (one column a block) into its K slice's partials [M, N]: lane (g, t)
    holds activation rows 2t (acc0, acc2) and 2t + 1 (acc1, acc3) of weight rows rows0 (acc0, acc1) and rows1."""
    m = (2 * t)[:, None]
    out = ws_ptr + tl.program_id(1) * stride_ws
    tl.store(out + m * N + rows0, acc0, mask=(rows0 < N) & (m < M))
    tl.store(out + (m + 1) * N + rows0, acc1, mask=(rows0 < N) & (m + 1 < M))
    tl.store(out + m * N + rows1, acc2, mask=(rows1 < N) & (m < M))
    tl.store(out + (m + 1) * N + rows1, acc3, mask=(rows1 < N) & (m + 1 < M))


@triton.jit
def step_activations(a_row, step, a_in):
    """The B registers of a K step's eight MMAs, (x_c, y_c) for MMA c, from the lane's 32 activations of the step:
    x0, x1, ..., x7, y0, y1, ..., y7."""
    x0, y0, x1, y1 = activation_pairs(a_row + step * 64, a_in)
    x2, y2, x3, y3 = activation_pairs(a_row + step * 64 + 4, a_in)
    x4, y4, x5, y5 = activation_pairs(a_row + step * 64 + 8, a_in)
    x6, y6, x7, y7 = activation_pairs(a_row + step * 64 + 12, a_in)
    return x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def step_codes(w_ptr, tile, g, step, K, TILED: tl.constexpr):
    """Where `block_words` reads a K step's codes for the warp's first block: (pointer, row g there), the step's
    tile (`code_tiles`, one contiguous 4 KB of the program's 64 rows) or the rows as stored."""
    if TILED:
        return step_tile(w_ptr, tile, step, K), g
    return w_ptr, tile * 64 + g
