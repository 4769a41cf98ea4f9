"""The MXFP4 and NVFP4 decode GEMM on mma.sync: out[M <= 8, N] = A[M, K] @ dequantize(W)[N, K].T (+ bias), bf16
activations, e2m1 codes read in the order `quantize` stores them (or in `code_tiles`' tiles), through inline PTX
(sm_80+).

It is the int4 decode kernel's design (`gemm_int4_mma`) with e2m1 codes: one warp per 64 weight rows, four 16-row
blocks each the A operand of `mma.sync.m16n8k16`, the activations its B operand, and K mapped onto the MMA's slots so
that a lane reads its codes in stored order (`mma_fragments`). In each 128-long K step lane t takes codes 32t ..
32t + 31 of its rows: one MXFP4 block, or two NVFP4 blocks (its words 0-1 and 2-3).

An MMA's 16 K slots span four lanes, hence four blocks, so the block scale multiplies each decoded pair before the
MMA, as `codes.fp4_values` does in the in-register kernel: a pair's bits give its two values times 2^-126
(`codes.fp4_pair_lines`), and one packed multiply makes each the value times its scale, exactly:
- MXFP4: by 2^(e - 1) for E8M0 code e, 2^126 times the scale, a normal bf16 for e <= 128 (scales up to 2). Where a
  lane's scale is larger (or NaN, code 255), the whole warp takes that K step in two multiplies: by 2^126, then by
  the scale. Weights rarely need scales past 2, so the decision, one warp vote a step, almost always picks one.
- NVFP4: by its e4m3 scale times 2^118, and the fp32 sum by the global scale times 2^8 at the end
  (`codes.NVFP4_PRESCALE`).
The step's eight MMAs chain through the fp32 accumulator, carried across steps.

The scales are read in a layout packed per lane (`pack_fp4_lanes`): a lane's scales of a step (its two rows in each
of the four blocks) are one 8-byte (MXFP4) or 16-byte (NVFP4) copy, as the int4 kernel reads its zero points: row-major
scales cost the int4 kernel 16 scattered copies a warp and step
(docs/decisions/0008-int4-mma-lane-packed-scales-at-m1.md).

K is split across programs as the int4 kernel splits it (`gemm_int4_mma.int4_mma_split`), the tile's last slice
summing the fp32 partials (`splitk.py`). linear_fp4_lanes takes it at one row (the option `fp4_lanes`, on): the 32
layers' FP4 GEMMs at M = 1 in one CUDA graph took 2.146 ms (MXFP4) and 2.200 (NVFP4) over tiles against 3.014 and
3.466 in registers, 2.46x and 2.40x bf16 (H100, docs/decisions/0031-fp4-decode-on-mma-sync.md).

Inline PTX does not run under Triton's interpreter: there `supports` is false and the caller takes
`gemm_weight_only`. tests/kernels/test_gemm_fp4_mma.py runs this kernel under the interpreter with its PTX run by
tests/ptx_emulator.py, and on the GPU, both against an fp64 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability, float_cast_mode, interpreting
from fxquant.kernels.code_tiles import TILE_ROWS, is_tiled
from fxquant.kernels.codes import FORMATS, NVFP4_UNSCALE, fp4_pair_lines, scale_bf16_pair
from fxquant.kernels.dependent_launch import await_previous, launch_options, start_next
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.gemm_int4_mma import MAX_M, STEP_K, int4_mma_split
from fxquant.kernels.launch import cdiv, visible
from fxquant.kernels.mma_fragments import (
    block_words,
    columns,
    mma_line,
    stack,
    step_activations,
    step_codes,
    store_partials,
    warp_plan,
)
from fxquant.kernels.splitk import counters, reduce_partials, sum_if_last_slice

ROWS = TILE_ROWS  # weight rows per program: four 16-row MMA blocks
BLOCKS = {"mxfp4": 32, "nvfp4": 16}  # codes a scale covers
TWO_POW_126 = "0x7E807E80"  # 2^126 in both halves of a bf16 pair


def _step_asm(mx: bool) -> str:
    """PTX for one 16-row block and one K step. Operands: $0-$3 the fp32 accumulator out (C fragment); $4-$7 row
    g's four words, $8-$11 row g + 8's; $12, $13 row g's multipliers of words 0-1 and 2-3, $14, $15 row g + 8's
    (bf16 pairs: MXFP4's scale, times 2^126 unless mx, NVFP4's scale times 2^118); $16 + 2c, $17 + 2c the activation
    pairs of MMA c; $32-$35 the accumulator in. mx: each pair is first multiplied by 2^126."""
    lines = ["{", ".reg .b32 m, s, a0, a1, a2, a3, unbias;", f"mov.b32 unbias, {TWO_POW_126};"]
    for c in range(8):
        u, e = divmod(c, 2)
        half = u // 2  # words 0-1 or 2-3: an NVFP4 lane's first or second block
        for reg, word, shift, scale in ((0, 4 + u, 8 * e, 12 + half), (1, 8 + u, 8 * e, 14 + half),
                                        (2, 4 + u, 8 * e + 4, 12 + half), (3, 8 + u, 8 * e + 4, 14 + half)):
            lines += fp4_pair_lines(f"a{reg}", f"${word}", shift)
            if mx:  # the codes' values, exactly, then times the E8M0 scale: exact, save overflow to infinity
                lines.append(f"mul.rn.bf16x2 a{reg}, a{reg}, unbias;")
            lines.append(f"mul.rn.bf16x2 a{reg}, a{reg}, ${scale};")
        acc = "$32, $33, $34, $35" if c == 0 else "$0, $1, $2, $3"
        lines.append(mma_line("bf16", "a0, a1, a2, a3", f"${16 + 2 * c}, ${17 + 2 * c}", acc))
    return "\n".join(lines + ["}"])


STEP_UNBIASED = tl.constexpr(_step_asm(mx=True))  # MXFP4 with a scale past 2 in the warp: two multiplies
STEP_SCALED = tl.constexpr(_step_asm(mx=False))  # NVFP4, and MXFP4's scales up to 2: one multiply
ONE_MULTIPLY_MAX = tl.constexpr(128)  # the largest E8M0 code whose 2^(e - 1) is a bf16 (exponent field e + 126 <= 254)
STEP_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["r"] * 28 + ["f"] * 4))


@triton.jit
def _multiplier(code, FMT: tl.constexpr, UNBIASED: tl.constexpr):
    """A scale code's bf16-pair multiplier: 2^(e - 1) for MXFP4 code e (e <= ONE_MULTIPLY_MAX; bf16 exponent field
    e + 126), or with UNBIASED the scale itself (`codes.scale_bf16_pair`); NVFP4's scale times 2^118."""
    if FMT == 2 and not UNBIASED:
        return (code + 126) * 0x00800080
    return scale_bf16_pair(code, FMT)


@triton.jit
def _byte_multipliers(word, FMT: tl.constexpr, UNBIASED: tl.constexpr = False):
    """The multipliers (`_multiplier`) of the four scale codes in each lane's word, byte 0 first."""
    return (_multiplier(word & 255, FMT, UNBIASED), _multiplier((word >> 8) & 255, FMT, UNBIASED),
            _multiplier((word >> 16) & 255, FMT, UNBIASED), _multiplier((word >> 24) & 255, FMT, UNBIASED))


@triton.jit
def _largest_code(word):
    """The largest byte of the words of all 32 lanes, as one value (a warp reduction)."""
    return tl.max(tl.maximum(tl.maximum(word & 255, (word >> 8) & 255),
                             tl.maximum((word >> 16) & 255, (word >> 24) & 255)), axis=0)


@triton.jit
def _block_step(w0, w1, m0, m1, m2, m3, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                c0, c1, c2, c3, UNBIASED: tl.constexpr):
    """One K step of one 16-row block: its C fragment ([32] each) c0..c3 plus the step's products, from the words
    w0, w1 of rows g and g + 8 (`mma_fragments.block_words`); m0..m3 the multipliers as `_step_asm` takes them,
    UNBIASED: each pair times 2^126 first."""
    r0, r1, r2, r3 = columns(w0)
    q0, q1, q2, q3 = columns(w1)
    return tl.inline_asm_elementwise(
        STEP_UNBIASED if UNBIASED else STEP_SCALED, STEP_CONSTRAINTS,
        [r0, r1, r2, r3, q0, q1, q2, q3, m0, m1, m2, m3,
         x0, y0, x1, y1, x2, y2, x3, y3, x4, y4, x5, y5, x6, y6, x7, y7, c0, c1, c2, c3],
        dtype=(tl.float32,) * 4, is_pure=True, pack=1)


@triton.jit
def _four_blocks(wa0, wa1, wb0, wb1, wc0, wc1, wd0, wd1, ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3,
                 mc0, mc1, mc2, mc3, md0, md1, md2, md3, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6,
                 y7, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, UNBIASED: tl.constexpr):
    """One K step of the program's four 16-row blocks a, b, c, d: their C fragments in and out, each block with
    its words and four multipliers (`_step_asm`'s $12-$15)."""
    a0, a1, a2, a3 = _block_step(wa0, wa1, ma0, ma1, ma2, ma3, x0, x1, x2, x3, x4, x5, x6, x7,
                                 y0, y1, y2, y3, y4, y5, y6, y7, a0, a1, a2, a3, UNBIASED)
    b0, b1, b2, b3 = _block_step(wb0, wb1, mb0, mb1, mb2, mb3, x0, x1, x2, x3, x4, x5, x6, x7,
                                 y0, y1, y2, y3, y4, y5, y6, y7, b0, b1, b2, b3, UNBIASED)
    c0, c1, c2, c3 = _block_step(wc0, wc1, mc0, mc1, mc2, mc3, x0, x1, x2, x3, x4, x5, x6, x7,
                                 y0, y1, y2, y3, y4, y5, y6, y7, c0, c1, c2, c3, UNBIASED)
    d0, d1, d2, d3 = _block_step(wd0, wd1, md0, md1, md2, md3, x0, x1, x2, x3, x4, x5, x6, x7,
                                 y0, y1, y2, y3, y4, y5, y6, y7, d0, d1, d2, d3, UNBIASED)
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _fp4_mma_kernel(a_ptr, w_ptr, s_ptr, gs_ptr, ws_ptr, c_ptr, bias_ptr, counter_ptr, M, N, K, stride_am,
                    stride_wn, stride_ws, FMT: tl.constexpr, SPLIT_K: tl.constexpr, LAST_SLICE_SUMS: tl.constexpr,
                    HAS_BIAS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, STAGES: tl.constexpr,
                    PDL: tl.constexpr, TILED: tl.constexpr):
    await_previous(PDL)
    g, t, tile, rows0, rows1, a_row, a_in, steps, first, last = warp_plan(a_ptr, stride_am, M, K, SPLIT_K)
    # the C fragments of blocks a, b, c, d: registers 0 and 1 rows g, 2 and 3 rows g + 8
    zero = tl.zeros((32,), tl.float32)
    a0, a1, a2, a3, b0, b1, b2, b3 = zero, zero, zero, zero, zero, zero, zero, zero
    c0, c1, c2, c3, d0, d1, d2, d3 = zero, zero, zero, zero, zero, zero, zero, zero
    for step in tl.range(first, last, num_stages=STAGES):
        record = ((tile * steps + step) * 8 + g) * 4 + t  # this lane's scales in pack_fp4_lanes' layout
        x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7 = step_activations(a_row, step, a_in)
        w_step, local = step_codes(w_ptr, tile, g, step, K, TILED)
        # the codes are loaded before the branch below, so that the pipeliner keeps them in flight
        wa0, wa1 = block_words(w_step, local, stride_wn, t, step, N, TILED)
        wb0, wb1 = block_words(w_step, local + 16, stride_wn, t, step, N, TILED)
        wc0, wc1 = block_words(w_step, local + 32, stride_wn, t, step, N, TILED)
        wd0, wd1 = block_words(w_step, local + 48, stride_wn, t, step, N, TILED)
        if FMT == 2:  # bytes (block, half): one scale a row and step, for both of its word pairs
            s0, s1 = tl.split(tl.load(s_ptr + record[:, None] * 2 + tl.arange(0, 2)[None, :]))
            unbiased = tl.maximum(_largest_code(s0), _largest_code(s1)) > ONE_MULTIPLY_MAX  # the warp's vote
            if unbiased:
                ma0, ma2, mb0, mb2 = _byte_multipliers(s0, FMT, True)
                mc0, mc2, md0, md2 = _byte_multipliers(s1, FMT, True)
            else:
                ma0, ma2, mb0, mb2 = _byte_multipliers(s0, FMT)
                mc0, mc2, md0, md2 = _byte_multipliers(s1, FMT)
            ma1, ma3, mb1, mb3, mc1, mc3, md1, md3 = ma0, ma2, mb0, mb2, mc0, mc2, md0, md2
        else:  # a word a block, bytes (half, block of 16): two scales a row and step
            sa, sb, sc, sd = columns(tl.load(s_ptr + record[:, None] * 4 + tl.arange(0, 4)[None, :]))
            ma0, ma1, ma2, ma3 = _byte_multipliers(sa, FMT)
            mb0, mb1, mb2, mb3 = _byte_multipliers(sb, FMT)
            mc0, mc1, mc2, mc3 = _byte_multipliers(sc, FMT)
            md0, md1, md2, md3 = _byte_multipliers(sd, FMT)
            unbiased = False
        if unbiased:
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _four_blocks(
                wa0, wa1, wb0, wb1, wc0, wc1, wd0, wd1, ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3, mc0, mc1, mc2, mc3,
                md0, md1, md2, md3, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, True)
        else:
            a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3 = _four_blocks(
                wa0, wa1, wb0, wb1, wc0, wc1, wd0, wd1, ma0, ma1, ma2, ma3, mb0, mb1, mb2, mb3, mc0, mc1, mc2, mc3,
                md0, md1, md2, md3, x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7,
                a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, False)
    # the next kernel launches after the K loop, as gemm_int4_mma's does
    # (docs/decisions/0028-int4-mma-next-kernel-after-the-k-loop.md)
    start_next(PDL)
    acc0, acc1 = stack(a0, b0, c0, d0), stack(a1, b1, c1, d1)
    acc2, acc3 = stack(a2, b2, c2, d2), stack(a3, b3, c3, d3)
    if FMT == 3:  # the global scale, with the 2^8 the prescaled values were short of: a power of two, exact
        unscale = tl.load(gs_ptr) * NVFP4_UNSCALE
        acc0, acc1, acc2, acc3 = acc0 * unscale, acc1 * unscale, acc2 * unscale, acc3 * unscale
    store_partials(ws_ptr, stride_ws, acc0, acc1, acc2, acc3, t, rows0, rows1, M, N)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, c_ptr, bias_ptr, counter_ptr, tile, tl.arange(0, 8),  # MAX_M rows
                          tile * 64 + tl.arange(0, 64), M, N, N, 1, HAS_BIAS, SPLIT_K, OUT, CAST)


def _per_step(fmt: str) -> int:
    """Scales a row and K step of a lane: 32 codes over the format's blocks."""
    return 32 // BLOCKS[fmt]


def fp4_lane_layout_shape(N: int, K: int, fmt: str) -> tuple[int, ...]:
    """The shape of `pack_fp4_lanes`' words for an [N, K] weight: [N / 64 (rounded up), K / 128, 8 g, 4 t, words]."""
    return (cdiv(N, ROWS), K // STEP_K, 8, 4, 2 * _per_step(fmt))


def pack_fp4_lanes(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """MXFP4 or NVFP4 scale codes [N, K / block] (E8M0 or e4m3, as `quantize` makes them) as the kernel reads
    them: int32 words [N / 64 (zero-padded), K / 128, 8 g, 4 t, words], lane (g, t)'s bytes in order (block, half,
    part) for row 64 tile + 16 block + 8 half + g and scale block (K step 4 + t) parts + part, parts a lane's
    scales a row. Zero bytes pad: rows past N are never stored."""
    raw = scale.view(torch.uint8)
    N, blocks = raw.shape
    parts = _per_step(fmt)
    tiles, steps = cdiv(N, ROWS), blocks // (4 * parts)
    padded = torch.zeros((tiles * ROWS, blocks), dtype=torch.uint8, device=raw.device)
    padded[:N] = raw
    lanes = padded.reshape(tiles, 4, 2, 8, steps, 4, parts).permute(0, 4, 3, 5, 1, 2, 6)
    return lanes.reshape(tiles, steps, 8, 4, 8 * parts).contiguous().view(torch.int32)


def supports(a: torch.Tensor, fmt: str) -> str | None:
    """Why `fp4_mma_mm` does not take activations a [M, K] times an `fmt` weight, or None where it does: MXFP4 or
    NVFP4, M <= 8 on an sm_80+ GPU (not the interpreter), K a multiple of 128, bf16 rows viewable as int32 value
    pairs (bf16: the range a scaled e2m1 value needs)."""
    M, K = a.shape
    if fmt not in BLOCKS:
        return f"{fmt!r}: the kernel takes {list(BLOCKS)}"
    if not a.is_cuda or interpreting(_fp4_mma_kernel) or capability(a.device) < (8, 0):
        return "no sm_80+ GPU (or Triton's interpreter)"
    if not 0 < M <= MAX_M:
        return f"M = {M}: the kernel serves 1 to {MAX_M} rows"
    if K % STEP_K:
        return f"K = {K}: the kernel takes multiples of {STEP_K}"
    if a.dtype != torch.bfloat16:
        return f"{a.dtype} activations: the kernel takes bf16"
    if not (a.stride(1) == 1 and a.stride(0) % 2 == 0 and a.data_ptr() % 4 == 0):
        return "rows not viewable as int32 pairs of values"
    return None


def fp4_mma_mm(a, codes, lane_scale, fmt: str, global_scale=None, bias=None, *, split: int | None = None,
               stages: int = 3):
    """a [M <= 8, K] bf16 @ dequantize(codes)[N, K].T (+ bias): codes [N, K / 8] int32 words (8 codes each, as
    `quantize` packs them), or `code_tiles`' tiles as words [N / 64, K / 128, 64, 16]; lane_scale from
    `pack_fp4_lanes`; global_scale NVFP4's fp32 scalar. Returns [M, N] bf16. The caller checks `supports`."""
    M, K = a.shape
    tiled = is_tiled(codes)
    N = codes.shape[0] * ROWS if tiled else codes.shape[0]
    if fmt == "nvfp4" and global_scale is None:
        raise ValueError("fxquant: an NVFP4 product needs the weight's global scale")
    split = split or int4_mma_split(N, K)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device)
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    tiles = cdiv(N, ROWS)
    count = counters(a.device, tiles)
    visible(_fp4_mma_kernel)[(tiles, split)](
        a.view(torch.int32), codes, lane_scale, global_scale if global_scale is not None else lane_scale, ws, out,
        bias if bias is not None else out, count if count is not None else ws,
        M, N, K, a.stride(0) // 2, codes.stride(0), ws.stride(0),
        FMT=FORMATS[fmt], SPLIT_K=split, LAST_SLICE_SUMS=count is not None, HAS_BIAS=bias is not None,
        OUT=TORCH_TO_TL[a.dtype], CAST=float_cast_mode(_fp4_mma_kernel), STAGES=stages, TILED=tiled, num_warps=1,
        num_stages=stages, **launch_options(a.device))
    return out if count is not None else reduce_partials(ws, out, bias, TORCH_TO_TL[a.dtype])
