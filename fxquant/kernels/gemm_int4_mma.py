"""The int4 decode GEMM on mma.sync: out[M <= 8, N] = A[M, K] @ dequantize(W)[N, K].T (+ bias), int4 groups of a
multiple of 128 along K, with the codes read in the order `quantize` stores them, through inline PTX (sm_80+).

Each program is one warp and owns 64 weight rows: four 16-row blocks, each the A operand of
`mma.sync.m16n8k16`, whose B operand is the activations (K by up to 8 rows of A), so one MMA serves a whole
decode batch. K maps onto the MMA's slots so that a lane reads its codes in stored order (`mma_fragments`): in each
128-long K step, lane t takes codes 32t .. 32t + 31 of its rows, and one `lop3` extracts codes j and j + 4 of a word
together into a bf16x2 (or f16x2) register.

Scales and zero points are read in a layout packed per lane (`pack_lanes`): a lane's eight scales of a group (its
two rows in each of the four blocks) are one 32-byte copy, its eight zero points one 8-byte copy. Row-major scales
cost each K step 16 scattered 4-byte copies per warp, which kept the L1 busiest at 63% while DRAM ran at 29%
(docs/decisions/0008-int4-mma-lane-packed-scales-at-m1.md).

A code q becomes the exact integer q - z from bits, with no int -> float conversion: q ORed into the mantissa of 128.0
(bf16, ulp 1) or 1024.0 (f16) is 128 + q, and one packed FMA adds -(128 + z). fp16's wider mantissa also takes a code
four bits up where it lies, as 64.0 + q (ulp 1/16), so a word needs one shift, not three. Each block's eight MMAs of a
step chain through its fp32 accumulator, which the group's fp32 scale then multiplies, as in `gemm_weight_only`'s int4
path. The four blocks' chains are written interleaved in one PTX statement, so that ptxas overlaps them
(`mma_fragments.mma_order`). K is split across programs, each writing fp32 partials that the tile's last slice
(`splitk.py`) sums in a fixed order and casts. `tl.range`'s pipeliner keeps STAGES steps of codes, scales, zero points
and activations in flight as asynchronous copies while one is multiplied. What bounds the kernel is that reading: a
variant that only loads took 79-88% of its time on the Llama shapes, and the same codes tiled per (64 rows, 128-code
step) ran 6-18% faster (H100, BENCHMARKS.md, "The int4 decode GEMM's launch, split and code layout"). Under
`dependent_launch.weights_prefetched(True)` a program over tiles asks the L2 for its first steps of codes before it
waits for the previous kernel (16 KB in one run); off by default: in the 32-layer step it added 0.10 ms
(docs/decisions/0030-fp8-decode-weights-prefetched.md).

W4A8 (e4m3 activations per token, as int4_fp8 quantizes them) runs on the same step: each lane's codes of a step become
fp16 pairs (a byte permute and `cvt.rn.f16x2.e4m3x2` a pair, exact: e4m3 is a subset of fp16), the step takes the fp16
MMA, and the token's scale multiplies the sums once after the K loop, as `gemm_int4_fp8` does. Its K loop is 493 SASS
instructions for 256 codes a thread (554 before fp16's decode took one shift a word), against 367 for 128 in
`gemm_int4_fp8`'s decode tiles (`python -m bench.sass mma --e4m3`, `w4a8`). It takes int4_fp8's one-row GEMMs under the
option int4_fp8_lanes (on): the 32-layer step at one sequence took 3.470 against 4.293 GPU ms on the W4A8 kernel (H100,
docs/decisions/0043-w4a8-decode-on-the-int4-mma-kernel.md).

Inline PTX does not run under Triton's interpreter: there `supports` is false and the caller takes
`gemm_weight_only`, which computes the same product. tests/kernels/test_gemm_int4_mma.py runs this kernel under the
interpreter with its PTX run by an emulator of the instructions it uses (tests/ptx_emulator.py), and on the GPU,
both against an fp64 reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import capability, float_cast_mode, interpreting
from fxquant.kernels.code_tiles import TILE_ROWS, is_tiled, step_tile
from fxquant.kernels.dependent_launch import (
    await_previous,
    launch_options,
    prefetch_l2,
    prefetching,
    start_next,
    steps_ahead,
)
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, set_inside, visible
from fxquant.kernels.mma_fragments import (
    BLOCKS,
    block_words,
    columns,
    mma_line,
    mma_order,
    stack,
    step_activations,
    step_codes,
    store_partials,
    warp_plan,
)
from fxquant.kernels.splitk import counters, reduce_partials, sum_if_last_slice

STEP_K = 128  # codes per row per K step: 4 lanes x 32; int4 groups must be multiples of it
ROWS = TILE_ROWS  # weight rows per program: four 16-row MMA blocks
MAX_M = 8  # activation rows one m16n8k16 MMA takes as its B operand
_serves_rows = [1]  # the most activation rows linear_int4_lanes gives this kernel (`serving_up_to`)
_offsets_after = [False]  # bf16 zero points applied after the MMAs by default (`zero_points_after`)


def _step_asm(magic: str, fma: str, one: str, dtype: str, offset_after: bool = False,
              high: tuple[str, str] | None = None) -> str:
    """PTX for one K step of the program's four 16-row blocks. Operands: $4b-$4b+3 block b's fp32 accumulator out (C
    fragment); $16 + 8b .. + 3 row g's four words of block b, + 4 .. + 7 row g + 8's; $48 + 2b, $49 + 2b -(magic + z)
    for block b's two rows as x2 pairs (as fp32 where offset_after); $56 + 2c, $57 + 2c the activation pairs of MMA c.

    Each block's eight MMAs chain through its accumulator, in the order c = 0..7; the blocks' chains interleave as
    `mma_fragments.mma_order` says. A word's codes j and j + 4 are one pair, taken from bits 4j and 4j + 16 by a shift
    and a lop3; high (fp16): (magic', magic' - magic) for a pair taken where it lies, four bits up: magic' with an
    ulp of 1/16 makes it magic' + q, and the zero points' addend less magic' - magic makes that q - z, so that a word
    takes one shift, not three.

    offset_after: the MMAs take the codes as decoded, magic + q, and each block's sums then add -(magic + z) times
    the step's activation sums, which eight more MMAs with an all-ones A operand give (D row = the column's sum). One
    packed FMA a pair of codes (128 a step) becomes 8 MMAs and 16 fp32 FMAs a step."""
    lines = ["{", ".reg .b32 s0, s1, zero, one;",
             ".reg .b32 " + ", ".join(f"a{b}_{r}" for b in range(BLOCKS) for r in range(4)) + ";",
             "mov.b32 zero, 0;", f"mov.b32 one, {one};"]
    if high:  # h_i = -(magic + z) + (magic' - magic) = -(magic' + z), exact: integers under 2048
        lines += [".reg .b32 gap, " + ", ".join(f"h{i}" for i in range(2 * BLOCKS)) + ";", f"mov.b32 gap, {high[1]};"]
        lines += [f"{fma} h{i}, one, ${48 + i}, gap;" for i in range(2 * BLOCKS)]

    def pairs(b: int, e: int, words: tuple[int, int]) -> list[str]:
        """Registers a{b}_0..3: codes (2e, 2e + 4) of rows g, g + 8, then (2e + 1, 2e + 5), each as magic + q (or
        high's magic + 16 q): (w & mask) | magic puts two codes in the mantissas of a packed pair, exactly."""
        out = []
        if high:  # codes 2e and 2e + 1 lie at bits 8e and 8e + 4: one shift by 8e a word
            sources = [f"${word}" for word in words]
            if e:
                out += [f"shr.u32 s{i}, ${word}, 8;" for i, word in enumerate(words)]
                sources = ["s0", "s1"]
            for reg in range(4):
                mask, bits = ("0x00f000f0", high[0]) if reg >= 2 else ("0x000f000f", magic)
                out.append(f"lop3.b32 a{b}_{reg}, {sources[reg % 2]}, {mask}, {bits}, 0xea;")
            return out
        for reg in range(4):
            shift = 8 * e + 4 * (reg >= 2)
            source = f"${words[reg % 2]}"
            if shift:
                out.append(f"shr.u32 s0, {source}, {shift};")
                source = "s0"
            out.append(f"lop3.b32 a{b}_{reg}, {source}, 0x000f000f, {magic}, 0xea;")
        return out

    def mma(b: int, c: int) -> list[str]:
        u, e = divmod(c, 2)
        out = pairs(b, e, (16 + 8 * b + u, 20 + 8 * b + u))  # rows g and g + 8
        # (magic + q) * 1 - (magic + z) = q - z, exact: |q - z| <= 15, ulp 1 (high: magic' + q less magic' + z)
        for reg in range(4 * (not offset_after)):
            addend = f"h{2 * b + reg % 2}" if high and reg >= 2 else f"${48 + 2 * b + reg % 2}"
            out.append(f"{fma} a{b}_{reg}, a{b}_{reg}, one, {addend};")
        acc = ", ".join(f"${4 * b + r}" for r in range(4))
        regs = ", ".join(f"a{b}_{r}" for r in range(4))
        out.append(mma_line(dtype, regs, f"${56 + 2 * c}, ${57 + 2 * c}", "zero, zero, zero, zero" if c == 0 else acc,
                            acc))
        return out

    for b, c in mma_order():
        lines += mma(b, c)
    if offset_after:
        lines += _offset_after_asm(dtype)
    return "\n".join(lines + ["}"])


def _offset_after_asm(dtype: str) -> list[str]:
    """`_step_asm`'s sums of magic + q turned into sums of q - z: the step's activation sums (rows of an all-ones A
    times the eight MMAs' B operands), times each row's -(magic + z), added by one fp32 FMA a sum. The product of an
    fp32 -(magic + z) and an activation sum is exact in the FMA, which rounds once; what the bias costs is in the
    MMAs' fp32 sums, whose terms are up to (magic + 15) / 15 times larger (bf16: 143 / 15)."""
    lines = [".reg .f32 t0, t1, t2, t3;"]
    for c in range(8):
        acc = "zero, zero, zero, zero" if c == 0 else "t0, t1, t2, t3"
        lines.append(mma_line(dtype, "one, one, one, one", f"${56 + 2 * c}, ${57 + 2 * c}", acc, "t0, t1, t2, t3"))
    for b in range(BLOCKS):  # D registers 0, 1: row g, columns 2t and 2t + 1; 2, 3: row g + 8
        for reg in range(4):  # $48 + 2b, $49 + 2b: -(magic + z) as fp32 (`_offsets`)
            lines.append(f"fma.rn.f32 ${4 * b + reg}, ${48 + 2 * b + reg // 2}, t{reg % 2}, ${4 * b + reg};")
    return lines


_BF16 = ("0x43004300", "fma.rn.bf16x2", "0x3F803F80", "bf16")  # magic 128.0, one 1.0
_STEPS = {(torch.bfloat16, False): tl.constexpr(_step_asm(*_BF16)),
          # magic 1024.0; a code four bits up is 16 ulps of 64.0 (0x5400, ulp 1/16): 64 + q; the gap 960.0 (0x6380)
          (torch.float16, False): tl.constexpr(_step_asm("0x64006400", "fma.rn.f16x2", "0x3C003C00", "f16",
                                                         high=("0x54005400", "0x63806380"))),
          (torch.bfloat16, True): tl.constexpr(_step_asm(*_BF16, offset_after=True))}
STEP_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 56))


def step_asm(dtype: torch.dtype, offset_after: bool = False) -> tl.constexpr:
    """The K step's PTX for bf16 or fp16 activations; offset_after: the zero points applied after the MMAs, for bf16
    only (the MMAs' terms reach 143 times an activation there, where |q - z| <= 15; fp16's magic would make it 1039)."""
    if offset_after and dtype != torch.bfloat16:
        raise ValueError(f"fxquant: the int4 step applies zero points after the MMAs for bf16 only, not {dtype}")
    return _STEPS[dtype, offset_after]


@triton.jit
def _offsets(z, BF16: tl.constexpr, AFTER: tl.constexpr):
    """Zero points as packed pairs of -(magic + z), the addend that turns magic + q into q - z; AFTER (bf16): as
    fp32, which is that bf16 over 16 zero bits."""
    neg = z | (0xC300 if BF16 else 0xE400)  # -128.0 (bf16) or -1024.0 (f16) with z in its ulp-1 mantissa bits
    if AFTER:
        return neg << 16
    return neg | (neg << 16)


@triton.jit
def _block_columns(w_ptr, row0, stride_w, t, step, N, HAS_ZP: tl.constexpr, TILED: tl.constexpr):
    """One K step's words of one 16-row block, rows row0 (g) and row0 + 8 (g + 8), read as `mma_fragments.block_words`
    reads them: the eight [32] columns the step's PTX takes (row g's four, then row g + 8's)."""
    w0, w1 = block_words(w_ptr, row0, stride_w, t, step, N, TILED)  # [32, 4]: rows g and g + 8
    if not HAS_ZP:  # a symmetric code c is (c ^ 8) - 8
        w0 = w0 ^ -0x77777778  # 0x88888888 as int32: bit 3 of every nibble
        w1 = w1 ^ -0x77777778
    r0, r1, r2, r3 = columns(w0)
    q0, q1, q2, q3 = columns(w1)
    return r0, r1, r2, r3, q0, q1, q2, q3


@triton.jit
def _step_scales(s_ptr, z_ptr, tile, g, step, G, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BF16: tl.constexpr,
                 AFTER: tl.constexpr):
    """A K step's group scales (s0, s1 [32, 4]: rows g and g + 8 of each block) and its zero points as the addends
    -(magic + z) the PTX takes (eight [32], two a block; fp32 where AFTER, `step_asm`'s offset_after)."""
    group = step * 128 // GROUP
    lane_pack = (tile * G + group) * 8 + g  # this lane's record in pack_lanes' [tiles, G, 8 g, ...]
    s01 = tl.load(s_ptr + lane_pack[:, None] * 8 + tl.arange(0, 8)[None, :])  # [32, 8]: (block, half)
    s0, s1 = tl.split(tl.reshape(s01, (32, 4, 2)))  # [32, 4] each: half 0 (row g), half 1 (row g + 8)
    if HAS_ZP:  # eight uint8 zero points as two words: (block 0, halves 0-1), (block 1, halves 0-1), ...
        zw0, zw1 = tl.split(tl.load(z_ptr + lane_pack[:, None] * 2 + tl.arange(0, 2)[None, :]))
        za0, za1, zb0, zb1 = zw0 & 0xFF, (zw0 >> 8) & 0xFF, (zw0 >> 16) & 0xFF, (zw0 >> 24) & 0xFF
        zc0, zc1, zd0, zd1 = zw1 & 0xFF, (zw1 >> 8) & 0xFF, (zw1 >> 16) & 0xFF, (zw1 >> 24) & 0xFF
    else:
        za0 = tl.full((32,), 8, tl.int32)
        za1, zb0, zb1, zc0, zc1, zd0, zd1 = za0, za0, za0, za0, za0, za0, za0
    offsets = (_offsets(za0, BF16, AFTER), _offsets(za1, BF16, AFTER), _offsets(zb0, BF16, AFTER),
               _offsets(zb1, BF16, AFTER), _offsets(zc0, BF16, AFTER), _offsets(zc1, BF16, AFTER),
               _offsets(zd0, BF16, AFTER), _offsets(zd1, BF16, AFTER))
    return s0, s1, offsets


@triton.jit
def _step_codes(w_ptr, tile, g, t, step, K, N, stride_wn, HAS_ZP: tl.constexpr, TILED: tl.constexpr):
    """A K step's codes for the four 16-row blocks: 32 [32] columns, `_block_columns`' eight a block."""
    w_step, row0 = step_codes(w_ptr, tile, g, step, K, TILED)
    a0, a1, a2, a3, a4, a5, a6, a7 = _block_columns(w_step, row0, stride_wn, t, step, N, HAS_ZP, TILED)
    b0, b1, b2, b3, b4, b5, b6, b7 = _block_columns(w_step, row0 + 16, stride_wn, t, step, N, HAS_ZP, TILED)
    c0, c1, c2, c3, c4, c5, c6, c7 = _block_columns(w_step, row0 + 32, stride_wn, t, step, N, HAS_ZP, TILED)
    d0, d1, d2, d3, d4, d5, d6, d7 = _block_columns(w_step, row0 + 48, stride_wn, t, step, N, HAS_ZP, TILED)
    return (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
            c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7)


# Outputs $0..$3: the f16x2 B registers of `mma_fragments.activation_pairs`' pairs, codes (j, j + 4) for j = 0..3,
# from words $4 (e4m3 codes 0-3, byte j code j) and $5 (codes 4-7): prmt puts byte j of each in one 16-bit half,
# and cvt makes both fp16, exactly (e4m3 is a subset of fp16; sm_89+).
_E4M3_PAIRS = tl.constexpr("\n".join(
    ["{", ".reg .b32 p;", ".reg .b16 h, x;"]
    + [line for j in range(4) for line in (f"prmt.b32 p, $4, $5, 0x{(4 + j) << 4 | j:04x};", "mov.b32 {h, x}, p;",
                                           f"cvt.rn.f16x2.e4m3x2 ${j}, h;")]
    + ["}"]))


@triton.jit
def _e4m3_step_activations(a_row, step, a_in):
    """`step_activations` from e4m3 codes: the lane's 32 codes of the step are 8 words from a_row + 8 step, and each
    MMA's B registers are their fp16 pairs, x0, ..., x7, y0, ..., y7."""
    w0, w1, w2, w3 = columns(tl.load(a_row[:, None] + step * 32 + tl.arange(0, 4)[None, :], mask=a_in, other=0))
    w4, w5, w6, w7 = columns(tl.load(a_row[:, None] + step * 32 + 4 + tl.arange(0, 4)[None, :], mask=a_in, other=0))
    x0, y0, x1, y1 = _e4m3_pairs(w0, w1)
    x2, y2, x3, y3 = _e4m3_pairs(w2, w3)
    x4, y4, x5, y5 = _e4m3_pairs(w4, w5)
    x6, y6, x7, y7 = _e4m3_pairs(w6, w7)
    return x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7


@triton.jit
def _e4m3_pairs(lo, hi):
    return tl.inline_asm_elementwise(_E4M3_PAIRS, "=r,=r,=r,=r,r,r", [lo, hi], dtype=(tl.int32,) * 4, is_pure=True,
                                     pack=1)


@triton.jit
def _multiply(acc0, acc1, acc2, acc3, weights, activations, STEP: tl.constexpr):
    """The four blocks' accumulators after one K step: its codes (`_step_codes`), scales and zero points
    (`_step_scales`) times its activations (`step_activations`) by the PTX `STEP` (`step_asm`), each block's
    exact-operand fp32 sums then multiplied by the group's scale."""
    codes, scales = weights
    s0, s1, offsets = scales
    (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
     c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7) = codes
    oa0, oa1, ob0, ob1, oc0, oc1, od0, od1 = offsets
    x0, x1, x2, x3, x4, x5, x6, x7, y0, y1, y2, y3, y4, y5, y6, y7 = activations
    (p0, p1, p2, p3, q0, q1, q2, q3, r0, r1, r2, r3, u0, u1, u2, u3) = tl.inline_asm_elementwise(
        STEP, STEP_CONSTRAINTS,
        [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
         c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7,
         oa0, oa1, ob0, ob1, oc0, oc1, od0, od1,
         x0, y0, x1, y1, x2, y2, x3, y3, x4, y4, x5, y5, x6, y6, x7, y7],
        dtype=(tl.float32,) * 16, is_pure=True, pack=1)
    # the group's scale multiplies the step's exact-operand fp32 sums, as gemm_weight_only's int4 path does
    return (acc0 + stack(p0, q0, r0, u0) * s0, acc1 + stack(p1, q1, r1, u1) * s0,
            acc2 + stack(p2, q2, r2, u2) * s1, acc3 + stack(p3, q3, r3, u3) * s1)


@triton.jit
def _int4_mma_kernel(a_ptr, w_ptr, s_ptr, z_ptr, ws_ptr, c_ptr, bias_ptr, counter_ptr, a_scale_ptr, M, N, K, G,
                     stride_am, stride_wn, stride_ws, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, BF16: tl.constexpr,
                     SPLIT_K: tl.constexpr, LAST_SLICE_SUMS: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr,
                     CAST: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr, TILED: tl.constexpr,
                     STEP: tl.constexpr, PREFETCH: tl.constexpr = False, OFFSET_AFTER: tl.constexpr = False,
                     A_E4M3: tl.constexpr = False):
    if not PREFETCH:
        await_previous(PDL)
    g, t, tile, rows0, rows1, a_row, a_in, steps, first, last = warp_plan(a_ptr, stride_am, M, K, SPLIT_K)
    if A_E4M3:  # four codes a word: a lane's 32 codes of a step are 8 words
        a_row = a_ptr + g * stride_am + t * 8
    if PREFETCH:  # no kernel writes the codes: the L2 fetches them while the previous kernel ends
        tiles = step_tile(w_ptr, tile, steps_ahead(first, last), K)  # the slice's first tiles, one run of memory
        prefetch_l2(tiles[None, :] + tl.arange(0, 32)[:, None] * 32)  # 32 lines of 128 B a tile, one a lane
        await_previous(PDL)
    acc0 = tl.zeros((32, 4), tl.float32)
    acc1 = tl.zeros((32, 4), tl.float32)
    acc2 = tl.zeros((32, 4), tl.float32)
    acc3 = tl.zeros((32, 4), tl.float32)
    for step in tl.range(first, last, num_stages=STAGES):
        scales = _step_scales(s_ptr, z_ptr, tile, g, step, G, GROUP, HAS_ZP, BF16, OFFSET_AFTER)
        if A_E4M3:
            activations = _e4m3_step_activations(a_row, step, a_in)
        else:
            activations = step_activations(a_row, step, a_in)
        codes = _step_codes(w_ptr, tile, g, t, step, K, N, stride_wn, HAS_ZP, TILED)
        acc0, acc1, acc2, acc3 = _multiply(acc0, acc1, acc2, acc3, (codes, scales), activations, STEP)
    # The next kernel launches after the K loop, as the fp8 GEMM's does: launched at the start, its waiting programs
    # took this one's slots (32 layers of the four decode GEMMs, H100: 2.960 -> 2.397 ms;
    # docs/decisions/0028-int4-mma-next-kernel-after-the-k-loop.md)
    start_next(PDL)
    if A_E4M3:  # the per-token scales, constant along K, multiply the sums once, as gemm_int4_fp8's do
        sa0 = tl.load(a_scale_ptr + 2 * t, mask=2 * t < M, other=0.0)[:, None]  # acc0, acc2: activation row 2t
        sa1 = tl.load(a_scale_ptr + 2 * t + 1, mask=2 * t + 1 < M, other=0.0)[:, None]
        acc0, acc1, acc2, acc3 = acc0 * sa0, acc1 * sa1, acc2 * sa0, acc3 * sa1
    store_partials(ws_ptr, stride_ws, acc0, acc1, acc2, acc3, t, rows0, rows1, M, N)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, c_ptr, bias_ptr, counter_ptr, tile, tl.arange(0, 8),  # MAX_M rows
                          tile * 64 + tl.arange(0, 64), M, N, N, 1, HAS_BIAS, SPLIT_K, OUT, CAST)


def lane_layout_shape(N: int, K: int, group: int) -> tuple[int, ...]:
    """The shape of `pack_lanes`' scales for an [N, K] weight in groups of `group`."""
    return (cdiv(N, ROWS), K // group, 8, 4, 2)


def lane_order(t: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, G] (scales, zero points) in the kernel's per-lane layout: [N / 64 (rounded up,
    zero-padded), G, 8 g, 4 blocks, 2 halves], row = 64 tile + 16 block + 8 half + g."""
    N, G = t.shape
    tiles = lane_layout_shape(N, G, 1)[0]
    padded = torch.zeros((tiles * ROWS, G), dtype=t.dtype, device=t.device)
    padded[:N] = t
    return padded.reshape(tiles, 4, 2, 8, G).permute(0, 4, 3, 1, 2).contiguous()


def pack_lanes(scale: torch.Tensor, zero_point: torch.Tensor | None):
    """int4 scales [N, G] fp32 and zero points [N, G] uint8 as the kernel reads them: `lane_order`, the zero points
    then viewed as int32 words [tiles, G, 8, 2]. Returns (scales, zero points or None)."""
    zeros = None if zero_point is None else lane_order(zero_point).reshape(-1, scale.shape[1], 8, 8).view(torch.int32)
    return lane_order(scale), zeros


def serving_up_to(rows: int):
    """linear_int4_lanes launched inside the block gives this kernel up to `rows` activation rows (at most MAX_M),
    rather than one: at M = 8 it ran 13-34% slower than the in-register kernel on four of five Llama shapes over
    codes in rows (docs/decisions/0008-int4-mma-lane-packed-scales-at-m1.md), and over tiles the 32 layers' GEMMs
    took 2.822 against 2.402 ms (H100, `python -m bench.int4_chain --rows`; BENCHMARKS.md, "The int4 GEMMs past one
    row and the lm_head quantized, on the H100")."""
    if not 1 <= rows <= MAX_M:
        raise ValueError(f"fxquant: the int4 mma.sync kernel serves 1 to {MAX_M} rows, not {rows}")
    return set_inside(_serves_rows, rows)


def zero_points_after(on: bool):
    """Inside the block, `int4_mma_mm` applies bf16 zero points after the MMAs (`step_asm`'s offset_after) unless
    told otherwise: to time the step both ways."""
    return set_inside(_offsets_after, on)


def serves_rows() -> int:
    """The most activation rows linear_int4_lanes gives this kernel: 1 unless `serving_up_to` says otherwise."""
    return _serves_rows[0]


def supports(a: torch.Tensor, group: int) -> str | None:
    """Why `int4_mma_mm` does not take activations a [M, K] with int4 groups of `group`, or None where it does:
    M <= 8 on an sm_80+ GPU (sm_89+ for e4m3; not the interpreter), K and the group multiples of 128, bf16/fp16 rows
    viewable as int32 value pairs, or e4m3 rows as int32 quads."""
    M, K = a.shape
    e4m3 = a.dtype == torch.float8_e4m3fn
    if not a.is_cuda or interpreting(_int4_mma_kernel) or capability(a.device) < ((8, 9) if e4m3 else (8, 0)):
        return f"no sm_{89 if e4m3 else 80}+ GPU (or Triton's interpreter)"
    if not 0 < M <= MAX_M:
        return f"M = {M}: the kernel serves 1 to {MAX_M} rows"
    if K % STEP_K or group % STEP_K:
        return f"K = {K}, group {group}: the kernel takes multiples of {STEP_K}"
    if a.dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        return f"{a.dtype} activations: the kernel takes bf16, fp16 or e4m3 codes"
    per_word = 4 if e4m3 else 2
    if not (a.stride(1) == 1 and a.stride(0) % per_word == 0 and a.data_ptr() % 4 == 0):
        return f"rows not viewable as int32 words of {per_word} values"
    return None


@functools.lru_cache(maxsize=256)
def int4_mma_split(N: int, K: int) -> int:
    """K slices: toward 900 programs (6.8 per SM of an H200), keeping at least 3 K steps per slice and at most 16
    slices for the reduce to sum. An M = 1 sweep of split and stages on the Llama-3-8B shapes
    (docs/decisions/0009-int4-split-and-reduce.md) found 10 slices best on 6144x4096 (10.4 us), 5 on
    14336x4096 (18.7), 15 within 0.1 us of the best 14 on 4096x14336, and 3 at 34.1 us on 28672x4096, where 4 took
    37.6; on 4096x4096, 9 and 8 took 8.2 and 8.3 us, 16 more than 8.6, and this gives 10. With the next kernel
    launched after the K loop, 32 layers of the four decode GEMMs in one graph took 2.397 ms under this rule against
    2.621 / 2.426 / 2.654 with K split toward 450 / 900 / 1800 programs each (H100, BENCHMARKS.md)."""
    steps = K // STEP_K
    return max(1, min(16, steps // 3, cdiv(900, cdiv(N, ROWS))))


def int4_mma_mm(a, codes, lane_scale, lane_zero, group: int, bias=None, *, split: int | None = None,
                stages: int = 3, offset_after: bool | None = None, a_scale=None, out_dtype=torch.bfloat16):
    """a [M <= 8, K] bf16/fp16 @ dequantize(codes)[N, K].T (+ bias): codes [N, K / 8] int32 words (8 codes each,
    as `quantize` packs them), or `code_tiles`' tiles as words [N / 64, K / 128, 64, 16]; lane_scale and lane_zero
    from `pack_lanes`; offset_after: `step_asm`'s (None: `zero_points_after`'s, for bf16). Returns [M, N] in a's
    dtype. W4A8: a [M, K] e4m3 codes and a_scale [M] fp32 per token, multiplied as fp16 on the fp16 MMA (exact:
    e4m3 and q - z are subsets of fp16), into out_dtype. The caller checks `supports`."""
    M, K = a.shape
    e4m3 = a.dtype == torch.float8_e4m3fn
    if e4m3 == (a_scale is None):
        raise ValueError("fxquant: int4_mma_mm takes a_scale with e4m3 activations, and only with them")
    mma_dtype = torch.float16 if e4m3 else a.dtype
    if offset_after is None:
        offset_after = _offsets_after[0] and mma_dtype == torch.bfloat16
    out_dtype = out_dtype if e4m3 else a.dtype
    tiled = is_tiled(codes)
    N = codes.shape[0] * ROWS if tiled else codes.shape[0]
    split = split or int4_mma_split(N, K)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device)
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    tiles = cdiv(N, ROWS)
    pdl = launch_options(a.device)
    count = counters(a.device, tiles)
    visible(_int4_mma_kernel)[(tiles, split)](
        a.view(torch.int32), codes, lane_scale, lane_zero if lane_zero is not None else lane_scale, ws, out,
        bias if bias is not None else out, count if count is not None else ws, a_scale if e4m3 else ws,
        M, N, K, K // group, a.stride(0) // (4 if e4m3 else 2), codes.stride(0), ws.stride(0),
        GROUP=group, HAS_ZP=lane_zero is not None, BF16=mma_dtype == torch.bfloat16, SPLIT_K=split,
        LAST_SLICE_SUMS=count is not None, HAS_BIAS=bias is not None, OUT=TORCH_TO_TL[out_dtype],
        CAST=float_cast_mode(_int4_mma_kernel), STAGES=stages, TILED=tiled, num_warps=1, num_stages=stages,
        STEP=step_asm(mma_dtype, offset_after), OFFSET_AFTER=offset_after, A_E4M3=e4m3,
        PREFETCH=tiled and prefetching(pdl), **pdl)
    return out if count is not None else reduce_partials(ws, out, bias, TORCH_TO_TL[out_dtype])
