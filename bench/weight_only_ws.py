"""A probe for the weight-only prefill: an int4 GEMM that dequantizes its weight tile by tile on warp-specialized
warps, against the product's route (the weight dequantized whole for cuBLAS) and bf16 cuBLAS, at prefill's M.

The tiled GEMM measured on 2026-12-05 (docs/decisions/0025-weight-only-prefill-stays-dequantized.md) lost because
its decode and its wgmma took turns in the same warps. Triton 3.6 splits a loop marked `warp_specialize=True` over
tensor descriptors into a producer partition (the copy engine's loads) and two consumer partitions, each a
warpgroup with its own accumulator over half of the first operand's rows (compiled for sm_90 at 4 warps a program:
12 warps, `setmaxnreg`; at 8 warps it does not split). Here the first operand is the weight, out.T = W @ A.T: each
consumer decodes only its own 64 weight rows into wgmma's register operand, and one consumer's decode can run while
the other's wgmma does.

Triton 3.6's split takes one dot a loop iteration and no join or reshape along the weight's rows. So the codes are
read in half order (`half_order`): in each 128-long K step, byte b holds code b in its low nibble and code b + 64 in
its high one, and the loop runs in 64-long half steps, each reading its step's bytes (the second time from the L2)
and shifting out its own nibble. Compiled, a variant that joined the two nibbles into one tile, one with two dots an
iteration and one that scaled each step's partial sums all stopped in Triton's warp-specialization pass. Triton 3.8
(CI's) stops there on this kernel too, while it still splits a loop whose dequantized operand is the second; the
CPU test runs the kernel under the interpreter, which ignores the split.

The weight tile is the values `dequantize_weight` writes, (q - z) * s in fp32 rounded once to bf16, so this GEMM
multiplies the same operands as the product's route. The scales and zero points are read transposed, [K / 128, N],
so that a step's are one copy of the copy engine's.

On the H100 (Triton 3.6.0, 2026-12-06) the split runs only with its copy boxes mended (`_halve_split_boxes`), and
then 64 of each 128 weight rows come out wrong at every tile; the loop unsplit is right and runs 0.38-0.51x of bf16
cuBLAS, below the product's route (bench/HISTORY.md, "2026-12-06: decode attention over codes in whole waves; the
warp-specialized weight-only GEMM wrong on the GPU; the dequantization on a side stream").

Run: python -m bench.weight_only_ws [--ms 1024 4096] [--sweep]
(correctness against the product's route first: a row that disagrees is named, with where in the weight's tile, and
not timed; then the times; the same loop without the split beside it; --sweep: other tiles.)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.common import values_after
from fxquant.kernels.cast import cast_float, float_cast_mode, interpreting
from fxquant.numerics.minifloat import unpack_nibbles

GROUP = 128
STEP_K = 128  # the half order's K step: 64 bytes a row, each holding codes b and b + 64
SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]  # o, merged q/k/v, merged gate/up, down
TILE = dict(BLOCK_N=128, BLOCK_M=128, num_warps=4, num_stages=3)  # 4 warps: the split needs them (see above)


@triton.jit
def _int4_ws_kernel(a_desc, w_desc, s_desc, z_desc, c_ptr, M, N, K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    STEP_K: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr, OUT: tl.constexpr,
                    CAST: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    # the programs that share a weight tile run one after another, so the L2 serves it to all of M's tiles
    row_tiles = tl.cdiv(M, BLOCK_M)
    n0 = tl.program_id(0) // row_tiles * BLOCK_N
    m0 = tl.program_id(0) % row_tiles * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for k in tl.range(0, K, STEP_K // 2, warp_specialize=WS, num_stages=STAGES):  # half steps of 64
        packed = w_desc.load([n0, k // STEP_K * (STEP_K // 2)])  # [BLOCK_N, 64] bytes: the step's, in half order
        q = (packed >> (4 * (k // (STEP_K // 2) % 2))).to(tl.int32) & 15  # this half's nibble of each byte
        s = tl.reshape(s_desc.load([k // GROUP, n0]), (BLOCK_N,))
        z = tl.reshape(z_desc.load([k // GROUP, n0]), (BLOCK_N,)).to(tl.int32)
        # (q - z) * s in fp32, rounded once to the activations' dtype: dequantize_weight's values
        w = cast_float((q - z[:, None]).to(tl.float32) * s[:, None], OUT, CAST)
        a = a_desc.load([m0, k])  # [BLOCK_M, 64]
        acc = tl.dot(w.to(DOT), tl.trans(a).to(DOT), acc)
    n = n0 + tl.arange(0, BLOCK_N)
    m = m0 + tl.arange(0, BLOCK_M)
    tl.store(c_ptr + m[None, :].to(tl.int64) * N + n[:, None], cast_float(acc, OUT, CAST),
             mask=(m < M)[None, :] & (n < N)[:, None])


def half_order(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K / 2] as `quantize` packs them (element 2i in the low nibble) -> [N, K / 2] bytes in half
    order: in each 128-long K step, byte b holds code b (low nibble) and code b + 64 (high nibble)."""
    codes = unpack_nibbles(packed).reshape(packed.shape[0], -1, 2, STEP_K // 2)  # [N, steps, half, 64]
    return (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(packed.shape).contiguous()


def transposed_scales(scale: torch.Tensor, zero_point: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 scales [N, G] fp32 and zero points [N, G] uint8 as the kernel reads them: [G, N], contiguous, the zero
    points widened to int16. The split gives each consumer half a step's box, 64 zero points: as bytes, every other
    stage's buffer lay 64 bytes from a 128-byte boundary, where the copy engine's stores must start (the launch
    failed, a misaligned address, on the H100); as int16 each buffer is 128 bytes."""
    return scale.t().contiguous(), zero_point.t().to(torch.int16).contiguous()


def int4_ws_mm(a: torch.Tensor, codes: torch.Tensor, scale_t: torch.Tensor, zero_t: torch.Tensor, *, ws: bool = True,
               tile: dict | None = None) -> torch.Tensor:
    """a [M, K] bf16 @ dequantize_weight(W)[N, K].T: W's codes [N, K / 2] in `half_order` (groups of 128 with zero
    points), scale_t and zero_t from `transposed_scales`. Returns [M, N] bf16."""
    t = {**TILE, **(tile or {})}
    (M, K), N = a.shape, codes.shape[0]
    if K % STEP_K or N % t["BLOCK_N"]:
        raise ValueError(f"bench.weight_only_ws: K = {K}, N = {N} must be whole steps of {STEP_K} and tiles of "
                         f"{t['BLOCK_N']}")
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    interpreted = interpreting(_int4_ws_kernel)
    args = (TensorDescriptor.from_tensor(a, [t["BLOCK_M"], STEP_K // 2]),
            TensorDescriptor.from_tensor(codes, [t["BLOCK_N"], STEP_K // 2]),
            TensorDescriptor.from_tensor(scale_t, [1, t["BLOCK_N"]]),
            TensorDescriptor.from_tensor(zero_t, [1, t["BLOCK_N"]]), out, M, N, K)
    meta = dict(BLOCK_N=t["BLOCK_N"], BLOCK_M=t["BLOCK_M"], STEP_K=STEP_K, GROUP=GROUP,
                DOT=tl.float32 if interpreted else tl.bfloat16, OUT=tl.bfloat16, CAST=float_cast_mode(_int4_ws_kernel),
                WS=ws and not interpreted, STAGES=t["num_stages"], num_warps=t["num_warps"],
                num_stages=t["num_stages"])
    grid = (triton.cdiv(M, t["BLOCK_M"]) * (N // t["BLOCK_N"]),)
    if meta["WS"]:
        _halve_split_boxes(_int4_ws_kernel.warmup(*args, grid=grid, **meta), t["BLOCK_N"])
    _int4_ws_kernel[grid](*args, **meta)
    return out


def _halve_split_boxes(kernel, block_n: int) -> None:
    """Triton 3.6's split loads each consumer's half of the weight's rows (codes, scales, zero points) with its own
    copy of half the box, into a buffer of half the box; but the compiled kernel's descriptor metadata, from which the
    launcher builds the copy engine's descriptors, keeps the whole box, so each copy wrote twice its buffer (the
    launch failed on the H100). The boxes are set to the halves the compiled loads take, checked in its IR first."""
    ir = kernel.asm["ttgir"]
    if f"x{block_n // 2}x{STEP_K // 2}xi8" not in ir or f"x{block_n // 2}xf32" not in ir:
        raise RuntimeError("bench.weight_only_ws: the compiled kernel's loads are not split in halves of the weight's "
                           f"{block_n} rows; its boxes cannot be set")
    for desc, half in zip(kernel.metadata.tensordesc_meta[1:], ([block_n // 2, STEP_K // 2], [1, block_n // 2],
                                                                [1, block_n // 2]), strict=True):
        desc["block_size"] = half


def candidates() -> dict[str, tuple[bool, dict]]:
    """The tiled rows of a run: the default tile warp-specialized and not, and with --sweep the other tiles that
    compile split without a spill for sm_90 under Triton 3.6 (92-142 KB of shared memory)."""
    rows = {"tiled": (True, {}), "tiled, no split": (False, {})}
    if "--sweep" in sys.argv:
        for bm, bn, stages in ((256, 128, 3), (128, 128, 4), (256, 128, 2), (128, 256, 3)):
            rows[f"tiled {bn}x{bm}, {stages} stages"] = (True, dict(BLOCK_N=bn, BLOCK_M=bm, num_stages=stages))
    return rows


def disagreement(out: torch.Tensor, routed: torch.Tensor, block_n: int) -> str | None:
    """None where out agrees with the product's route within 1e-2 of its largest output (the same bf16 operands
    summed in fp32 in two orders, each rounded once); else how far off, and where in the weight's row tile."""
    error = (out.float() - routed.float()).abs() / routed.float().abs().max()
    if error.max() < 1e-2:
        return None
    bad = (~(error < 1e-2)).reshape(out.shape[0], -1, block_n).any(0).any(0)  # by row of the weight's tile
    return (f"off the product's route by {error.max().item():.1e} ({out.isnan().float().mean().item():.1%} NaN); "
            f"rows of the {block_n}-row tile off: {bad[:block_n // 2].sum().item()} of the first half, "
            f"{bad[block_n // 2:].sum().item()} of the second")


def main():
    from bench.common import header, rows_against_bf16, table
    from fxquant.kernels.gemm_weight_only import weight_only_mm
    from fxquant.numerics import reference as R

    print(header())
    ms = [int(v) for v in values_after("--ms", ["1024", "4096"])]
    rows = []
    for n, k in SHAPES:
        q = R.quantize(torch.randn(n, k, device="cuda") * 0.02, "int4", ("group", GROUP))
        codes, (scale_t, zero_t) = half_order(q.data), transposed_scales(q.scale, q.zero_point)
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            routed = lambda: weight_only_mm(a, q.data, q.scale, "int4", GROUP, n, zero_point=q.zero_point)
            runs = {"bf16": lambda: a @ w_bf16.T, "dequantized": routed}
            for name, (ws, tile) in candidates().items():
                run = lambda ws=ws, tile=tile: int4_ws_mm(a, codes, scale_t, zero_t, ws=ws, tile=tile)
                off = disagreement(run(), routed(), {**TILE, **tile}["BLOCK_N"])
                if off:
                    print(f"{name}, {n}x{k} at M = {m}: {off}; not timed", flush=True)
                else:
                    runs[name] = run
            rows += rows_against_bf16(runs, **{"N x K": f"{n}x{k}", "M": m})
    print(f"int4 groups of {GROUP} with zero points; the tiled GEMMs' default tile {TILE}; each tiled row timed agrees "
          "with the dequantized route within 1e-2 of its largest output (a row that does not is named above, untimed)")
    print(table(rows))


if __name__ == "__main__":
    main()
