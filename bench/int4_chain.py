"""The int4 decode GEMMs of 32 Llama-3-8B layers at M = 1, in one CUDA graph: q/k/v (6144x4096), o (4096x4096),
gate/up (28672x4096) and down (4096x14336), each layer its own weights (3.8 GB of codes, scales and zero points,
far past the L2), against bf16 torch.mm over the same chain. A GEMM alone hides what its neighbours do to it: under
programmatic dependent launch the next kernel's programs take SM slots while this one runs, so the chain is the
unit a kernel change must win on before the 32-layer step.

Each row is the mma.sync kernel (`gemm_int4_mma`) at a split-K rule: the product's (`int4_mma_split`), or K cut
toward a program count per GEMM; with dependent launch on (as the decode step runs) and off; over the codes in rows,
as `quantize` packs them, and in tiles (`code_tiles`), as the backend holds them on the GPU. Last, the tiles at the
product's split with dependent launch on, at other pipeline depths (`int4_mma_mm`'s stages, 3 in the product), and
with each program's first codes asked of the L2 before it waits for the previous GEMM (`weights_prefetched`).

With --grid, only the tiles with dependent launch on, at every pair of a program count (`--programs`) and a
pipeline depth (`--stages`): fewer, longer programs keep more K steps in flight each.

With --floors, the GEMMs (also with each program's first codes asked of the L2 before the wait, and again last), then
what reading the chain's bytes costs without the GEMMs (`bench.read_floor`), over random words: the GEMMs' own programs
that only load (their access pattern's floor), the same read and summed across K slices as the GEMMs' are (their split-K
tail), and with four tiles a program; each GEMM's bytes read flat by a plain kernel, over a persistent grid and over
programs of 3 steps as the GEMMs' (the floor of 128 dependent kernels of these sizes); all 3.8 GB in one flat read (the
device's read ceiling); and the GEMM kernel over the same bytes as two GEMMs, each layer's K = 4096 weights stacked into
one and the down projections into another (the GEMM's own floor without 128 launches, ramps and tails).

With --offset-after, the tiles with each step's zero points applied before the MMAs (the product) and after them
(`gemm_int4_mma.step_asm`), in turn.

With --rows, the chain at M = 1 and 8 rows (or those given) on the mma.sync kernel (up to 8 rows), on the in-register
kernel that the backend gives more than one row, and on the W4A8 kernel over codes in rows and in tiles, each against
bf16 at the same M (`rows_chain`); with --rows and
--sweep, the in-register kernel alone at those M (up to 16) under other warps, depths and split-K targets.

Run: python -m bench.int4_chain [--programs 450 1800 ...] [--stages 4 5 ...] [--grid | --floors | --offset-after |
     --rows 1 4 8 [--sweep]]
"""

from __future__ import annotations

import itertools
import math
import sys

import torch
import triton.language as tl
import triton.testing

from bench.common import copy_bandwidth_gbs, header, table, values_after
from bench.read_floor import FLAT_WORDS, read_as_int4_programs, read_flat, read_then_sum_as_int4_programs
from fxquant.kernels.cast import float_cast_mode
from fxquant.kernels.code_tiles import tile_codes, untile_codes
from fxquant.kernels.dependent_launch import dependent_launches, launch_options, weights_prefetched
from fxquant.kernels.gemm_int4_fp8 import int4_fp8_mm
from fxquant.kernels.gemm_int4_mma import (
    MAX_M,
    STEP_K,
    _int4_mma_kernel,
    int4_mma_mm,
    int4_mma_split,
    pack_lanes,
    step_asm,
)
from fxquant.kernels.gemm_weight_only import weight_only_mm, weight_operands, wo_gemm_config
from fxquant.kernels.launch import cdiv
from fxquant.numerics import reference as R

LAYER = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # merged q/k/v, o, merged gate/up, down
LAYERS = 32
GROUP = 128
DEFAULT_PROGRAMS = (450, 1800)  # the product's split aims at 900: a smaller and a larger grid beside it
DEFAULT_STAGES = (2, 4, 5)  # the product's pipeline holds 3 K steps in flight
DEFAULT_ROWS = (1, 8)  # --rows: one row, and the eight one MMA takes


def int4_weight(n: int, k: int):
    """Random int4 codes in groups of 128 with zero points, as stored and in tiles (int32 words), and their scales and
    zero points packed per lane."""
    q = R.quantize(torch.randn(n, k, device="cuda") * 0.02, "int4", ("group", GROUP))
    a = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    codes, scale = weight_operands(a, q.data, q.scale, "int4", GROUP, n)
    tiles, _ = weight_operands(a, tile_codes(q.data), q.scale, "int4", GROUP, n)
    return codes, tiles, *pack_lanes(scale, q.zero_point)


def int4_operands(n: int, k: int):
    """Random int4 codes in groups of 128 with zero points in tiles: as both kernels take them (int32 words with the
    scales and zero points packed per lane for the mma.sync kernel; bytes with the row-major ones for the
    in-register kernel)."""
    q = R.quantize(torch.randn(n, k, device="cuda") * 0.02, "int4", ("group", GROUP))
    a = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    tile_bytes = tile_codes(q.data)
    tiles, scale = weight_operands(a, tile_bytes, q.scale, "int4", GROUP, n)
    return tiles, *pack_lanes(scale, q.zero_point), tile_bytes, q.scale, q.zero_point


def chain_operands() -> tuple[list, int]:
    """Every layer's four GEMMs as (K, *`int4_operands`), and the bytes the mma.sync kernel reads of them (codes, lane
    scales, zero points)."""
    layers = [[(k, *int4_operands(n, k)) for n, k in LAYER] for _ in range(LAYERS)]
    return layers, sum(t.nbytes for layer in layers for _, tiles, lane_scale, lane_zero, *_ in layer
                       for t in (tiles, lane_scale, lane_zero))


def rows_chain(ms: list[int], ceiling: float) -> list[dict]:
    """--rows: the chain at M activation rows on the mma.sync kernel up to 8 rows (its zero points applied before the
    MMAs and after them; and over the rows' e4m3 codes, as int4_fp8 runs one row), on the in-register kernel, which the
    backend gives every int4 weight-only GEMM of more than one row, and on the W4A8 kernel over the same e4m3 codes
    (int4_fp8's from 2 to 128 rows) with its codes in rows and in tiles, against bf16 at the same M. First, on the
    merged gate/up, the mma.sync and in-register kernels' largest difference over the largest output."""
    layers, nbytes = chain_operands()
    rows_of = {id(tb): untile_codes(tb) for layer in layers for *_, tb, _, _ in layer}  # the W4A8 kernel over rows
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in sorted({k for _, k in LAYER})}
        e4m3 = {k: R.quantize(x, "fp8_e4m3", "token") for k, x in xs.items()}  # W4A8's activations of the same rows
        bf16_ms = bf16_chain_ms(xs)
        torch.cuda.empty_cache()
        k, tiles, lane_scale, lane_zero, tile_bytes, scale, zero = layers[0][2]
        w4a8 = lambda k, codes, s, z: int4_fp8_mm(e4m3[k].data, e4m3[k].scale, codes, s, z, None, torch.bfloat16)
        w4a8_tiles, w4a8_rows = (w4a8(k, c, scale, zero) for c in (tile_bytes, rows_of[id(tile_bytes)]))
        if not torch.equal(w4a8_tiles, w4a8_rows):
            raise SystemExit(f"bench.int4_chain: the W4A8 kernel's tiles and rows disagree at M = {m}")
        kernels = {}
        if m <= MAX_M:
            on_mma = int4_mma_mm(xs[k], tiles, lane_scale, lane_zero, GROUP).float()
            in_registers = weight_only_mm(xs[k], tile_bytes, scale, "int4", GROUP, tiles.shape[0] * 64,
                                          zero_point=zero).float()
            error = ((on_mma - in_registers).abs().max() / in_registers.abs().max()).item()
            print(f"M = {m}: mma.sync against in-register on 28672x4096, max |difference| / max |output| {error:.1e}",
                  flush=True)
            if not error < 1e-2:  # two fp32 sums of the same exact products, each rounded once to bf16
                raise SystemExit(f"bench.int4_chain: the kernels disagree at M = {m} ({error:.1e})")
            kernels |= {
                "mma.sync": lambda: [int4_mma_mm(xs[k], t, ls, lz, GROUP)
                                     for layer in layers for k, t, ls, lz, *_ in layer],
                "mma.sync, zero points after the MMAs": lambda: [
                    int4_mma_mm(xs[k], t, ls, lz, GROUP, offset_after=True)
                    for layer in layers for k, t, ls, lz, *_ in layer],
                "mma.sync over e4m3 activations (W4A8)": lambda: [
                    int4_mma_mm(e4m3[k].data, t, ls, lz, GROUP, a_scale=e4m3[k].scale.reshape(-1))
                    for layer in layers for k, t, ls, lz, *_ in layer]}
        kernels |= {
            "in-register": lambda: [weight_only_mm(xs[k], tb, s, "int4", GROUP, t.shape[0] * 64, zero_point=z)
                                    for layer in layers for k, t, _, _, tb, s, z in layer],
            "W4A8 kernel over e4m3 activations, codes in rows": lambda: [
                w4a8(k, rows_of[id(tb)], s, z) for layer in layers for k, _, _, _, tb, s, z in layer],
            "W4A8 kernel over e4m3 activations, codes in tiles": lambda: [
                w4a8(k, tb, s, z) for layer in layers for k, _, _, _, tb, s, z in layer]}
        rows.append({"M": m, "kernels": "bf16 torch.mm", "ms": f"{bf16_ms:.3f}", "x bf16": "1.00"})
        for name, run in kernels.items():
            with dependent_launches(True):
                ms_ = replay_ms(run)
            rows.append({"M": m, "kernels": f"int4 {name}", "ms": f"{ms_:.3f}", "x bf16": f"{bf16_ms / ms_:.2f}",
                         "% copy": f"{100 * nbytes / ms_ / 1e6 / ceiling:.0f}"})
            print(rows[-1], flush=True)
    print(f"{LAYERS} layers x {len(LAYER)} GEMMs, one CUDA graph, codes in tiles (the W4A8 kernel's in rows too), "
          f"dependent launch on; int4 bytes (codes, lane scales, zero points): {nbytes / 1e9:.2f} GB")
    return rows


SWEEP = [(4, 3, 1), (4, 4, 1), (4, 3, 2), (4, 3, 0.5), (8, 3, 1), (8, 4, 2), (2, 3, 1), (2, 4, 2)]


def in_register_sweep(ms: list[int], ceiling: float) -> list[dict]:
    """--rows with --sweep: the in-register kernel's chain at M rows under other decode tiles' settings (warps,
    pipeline depth, and the split-K target times a factor), the backend's first: (4 warps, 3 stages, x1)."""
    layers, nbytes = chain_operands()
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for k in sorted({k for _, k in LAYER})}
        for warps, stages, factor in SWEEP:
            configs = {k: {**wo_gemm_config(m, k, "int4"), "num_warps": warps, "num_stages": stages}
                       for k in xs}
            for cfg in configs.values():
                cfg["programs"] = int(cfg["programs"] * factor)
            with dependent_launches(True):
                ms_ = replay_ms(lambda: [weight_only_mm(xs[k], tb, s, "int4", GROUP, t.shape[0] * 64, zero_point=z,
                                                        config=configs[k])
                                         for layer in layers for k, t, _, _, tb, s, z in layer])
            rows.append({"M": m, "warps": warps, "stages": stages, "split-K target": f"x{factor}",
                         "ms": f"{ms_:.3f}", "% copy": f"{100 * nbytes / ms_ / 1e6 / ceiling:.0f}"})
            print(rows[-1], flush=True)
    return rows


def split_toward(n: int, k: int, programs: int) -> int:
    """K slices that bring an N x K GEMM's 64-row tiles nearest `programs` programs, at least 2 K steps a slice."""
    return max(1, min(k // STEP_K // 2, round(programs / -(-n // 64))))


def chain_ms(layers, xs, split_rule, tiled: bool, stages: int = 3, offset_after: bool = False) -> float:
    """Median ms of one graph replay of every layer's four GEMMs, K split by split_rule(n, k) (None: the product's),
    over the codes as stored or tiled, `stages` K steps in flight, zero points applied after the MMAs or not."""
    def run():
        for layer in layers:
            for n, k, codes, tiles, lane_scale, lane_zero in layer:
                int4_mma_mm(xs[k], tiles if tiled else codes, lane_scale, lane_zero, GROUP, split=split_rule(n, k),
                            stages=stages, offset_after=offset_after)
    return triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median")


def offset_after_rows(layers, xs, row) -> list[dict]:
    """The tiles at the product's split with dependent launch, zero points applied before the MMAs (the product) and
    after them, twice each in turn, after one GEMM of each checked against the other."""
    for n, k, _, tiles, lane_scale, lane_zero in layers[0]:
        before, after = (int4_mma_mm(xs[k], tiles, lane_scale, lane_zero, GROUP, offset_after=o) for o in (False, True))
        print(f"{n}x{k}: the two differ by at most {(before.float() - after.float()).abs().max().item():.3g} "
              f"(output max {before.float().abs().max().item():.3g})", flush=True)
    rows = []
    with dependent_launches(True):
        for _, offset_after in itertools.product(range(2), (False, True)):
            name = "tiled, the product's split" + (", zero points after the MMAs" if offset_after else "")
            rows.append(row(name, True, chain_ms(layers, xs, lambda n, k: None, True, offset_after=offset_after)))
            print(rows[-1], flush=True)
    return rows


def bf16_chain_ms(xs) -> float:
    """Median ms of the same chain in bf16 torch.mm (cuBLAS); its 14 GB of weights go with the return."""
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for n, k in LAYER] for _ in range(LAYERS)]
    return triton.testing.do_bench_cudagraph(lambda: [xs[w.shape[1]] @ w.T for layer in weights for w in layer],
                                             rep=200, return_mode="median")


def random_int4_gemm(words: torch.Tensor, n: int, k: int):
    """An [n, k] int4 weight's operands as views of `words` (int32, filled with random bits here): tiles, lane
    scales and zero points, one run of memory in that order, and that run."""
    shapes = [(n // 64, k // STEP_K, 64, 16), (n // 64, k // GROUP, 8, 4, 2), (n // 64, k // GROUP, 8, 2)]
    sizes = [math.prod(shape) for shape in shapes]
    run = words[:sum(sizes)]
    tiles, scale, zero = (part.view(shape) for part, shape in zip(run.split(sizes), shapes, strict=True))
    tiles.random_()
    zero.copy_(torch.randint(0, 16, (zero.numel() * 4,), dtype=torch.uint8, device=words.device).view(torch.int32)
               .view(zero.shape))  # four uint8 zero points a word, each a valid code
    scale = scale.view(torch.float32)
    scale.uniform_(1e-3, 2e-3)
    return tiles, scale, zero, run


def gemm_words(n: int, k: int) -> int:
    """int32 words of `random_int4_gemm`'s run for an [n, k] weight: codes, then 64 scales and 16 zero-point words
    for each 64-row tile's group."""
    return n * k // 8 + (n // 64) * (k // GROUP) * (64 + 16)


def floor_row(name: str, ms: float, nbytes: int, bf16_ms: float, ceiling: float, pdl: str = "-") -> dict:
    row = {"kernels": name, "dependent launch": pdl, "ms": f"{ms:.3f}", "x bf16": f"{bf16_ms / ms:.2f}",
           "GB/s": f"{nbytes / ms / 1e6:.0f}", "% copy": f"{100 * nbytes / ms / 1e6 / ceiling:.0f}"}
    print(row, flush=True)
    return row


def int4_partials_only(a, tiles, lane_scale, lane_zero) -> torch.Tensor:
    """The int4 mma.sync kernel as `int4_mma_mm` launches it over tiles, at its split, but ending at its K slices'
    fp32 partials [split, M, N], which nothing sums: the GEMM without its split-K tail, the floor of a sum folded into
    the consumer."""
    M, K = a.shape
    n = tiles.shape[0] * 64
    split = int4_mma_split(n, K)
    ws = torch.empty((split, M, n), dtype=torch.float32, device=a.device)
    _int4_mma_kernel[(tiles.shape[0], split)](
        a.view(torch.int32), tiles, lane_scale, lane_zero, ws, ws, ws, ws, ws, M, n, K, K // GROUP, a.stride(0) // 2,
        tiles.stride(0), ws.stride(0), GROUP=GROUP, HAS_ZP=True, BF16=True, SPLIT_K=split, LAST_SLICE_SUMS=False,
        HAS_BIAS=False, OUT=tl.bfloat16, CAST=float_cast_mode(_int4_mma_kernel), STAGES=3, TILED=True,
        STEP=step_asm(a.dtype), num_warps=1, num_stages=3, **launch_options(a.device))
    return ws


def replay_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def chain_floors(xs, bf16_ms: float, ceiling: float) -> tuple[list[dict], int]:
    """The 128 GEMMs of the chain, and the reads of their bytes; returns the rows and the bytes."""
    per_layer = sum(gemm_words(n, k) for n, k in LAYER)
    chain = torch.empty(LAYERS * per_layer, dtype=torch.int32, device="cuda")
    gemms, start = [], 0
    for _ in range(LAYERS):
        for n, k in LAYER:
            gemms.append((n, k, *random_int4_gemm(chain[start:], n, k)))
            start += gemm_words(n, k)
    nbytes = chain.nbytes

    def gemm_chain():
        for _, k, tiles, scale, zero, _ in gemms:
            int4_mma_mm(xs[k], tiles, scale, zero, GROUP)

    rows = []
    for pdl in (True, False):
        with dependent_launches(pdl):
            rows.append(floor_row("128 int4 GEMMs, the product's split", replay_ms(gemm_chain), nbytes, bf16_ms,
                                  ceiling, "on" if pdl else "off"))
    with dependent_launches(True), weights_prefetched(True):
        rows.append(floor_row("the same, each program's first codes asked of the L2 before the wait",
                              replay_ms(gemm_chain), nbytes, bf16_ms, ceiling, "on"))
    with dependent_launches(True):
        rows.append(floor_row("128 int4 GEMMs, the product's split (again, last)", replay_ms(gemm_chain), nbytes,
                              bf16_ms, ceiling, "on"))
    rows.append(floor_row("128 reads as the GEMMs' programs (loads only)", replay_ms(
        lambda: [read_as_int4_programs(t, s, z, int4_mma_split(n, k)) for n, k, t, s, z, _ in gemms]),
        nbytes, bf16_ms, ceiling))
    rows.append(floor_row("128 reads as the GEMMs' programs, then their split-K sums", replay_ms(
        lambda: [read_then_sum_as_int4_programs(t, s, z, int4_mma_split(n, k)) for n, k, t, s, z, _ in gemms]), nbytes,
        bf16_ms, ceiling))
    rows.append(floor_row("128 reads as the GEMMs' programs, 4 tiles (4 warps) a program", replay_ms(
        lambda: [read_as_int4_programs(t, s, z, int4_mma_split(n, k), tiles_per_program=4)
                 for n, k, t, s, z, _ in gemms]), nbytes, bf16_ms, ceiling))
    rows.append(floor_row("128 flat reads, one a GEMM's bytes", replay_ms(lambda: [read_flat(g[-1]) for g in gemms]),
                          nbytes, bf16_ms, ceiling))
    rows.append(floor_row("128 flat reads, 3 steps of 16 KB a program", replay_ms(
        lambda: [read_flat(g[-1], programs=cdiv(g[-1].numel(), 3 * FLAT_WORDS)) for g in gemms]), nbytes, bf16_ms,
        ceiling))
    with dependent_launches(True):
        rows.append(floor_row("128 int4 GEMMs ending at their partials (no split-K sum)", replay_ms(
            lambda: [int4_partials_only(xs[k], t, s, z) for _, k, t, s, z, _ in gemms]), nbytes, bf16_ms, ceiling,
            "on"))
    rows.append(floor_row("one flat read of every byte", replay_ms(lambda: read_flat(chain)), nbytes, bf16_ms,
                          ceiling))
    return rows, nbytes


def floors(xs, bf16_ms: float, ceiling: float) -> list[dict]:
    """The chain of int4 GEMMs against kernels that only read its bytes; see the module's docstring."""
    rows, nbytes = chain_floors(xs, bf16_ms, ceiling)
    torch.cuda.empty_cache()
    merged = []
    for k, n in ((4096, LAYERS * sum(n for n, k in LAYER if k == 4096)), (14336, LAYERS * 4096)):
        words = torch.empty(gemm_words(n, k), dtype=torch.int32, device="cuda")
        merged.append((k, *random_int4_gemm(words, n, k)))
    with dependent_launches(True):
        rows.append(floor_row("2 int4 GEMMs of the same bytes, the product's split", replay_ms(
            lambda: [int4_mma_mm(xs[k], t, s, z, GROUP) for k, t, s, z, _ in merged]), nbytes, bf16_ms, ceiling,
            "on"))
    print(f"{LAYERS} layers x {len(LAYER)} GEMMs at M = 1, one CUDA graph; int4 bytes (codes, lane scales, zero "
          f"points): {nbytes / 1e9:.2f} GB; each kernel's reads summed and stored, so none is dead")
    return rows


def main():
    print(header())
    ceiling = copy_bandwidth_gbs()
    print(f"copy ceiling (read+write): {ceiling:.0f} GB/s")
    if "--rows" in sys.argv:
        ms = [int(v) for v in values_after("--rows", DEFAULT_ROWS)]
        print(table(in_register_sweep(ms, ceiling) if "--sweep" in sys.argv else rows_chain(ms, ceiling)))
        return
    programs = [int(v) for v in values_after("--programs", DEFAULT_PROGRAMS)]
    depths = [int(v) for v in values_after("--stages", DEFAULT_STAGES)]
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in sorted({width for _, width in LAYER})}
    bf16_ms = bf16_chain_ms(xs)
    torch.cuda.empty_cache()
    if "--floors" in sys.argv:
        rows = [{"kernels": "bf16 torch.mm", "ms": f"{bf16_ms:.3f}", "x bf16": "1.00"}]
        print(table(rows + floors(xs, bf16_ms, ceiling)))
        return
    layers = [[(n, k, *int4_weight(n, k)) for n, k in LAYER] for _ in range(LAYERS)]
    nbytes = sum(t.nbytes for layer in layers for _, _, codes, _, *lanes in layer for t in (codes, *lanes))
    rules = [("the product's split", lambda n, k: None)]
    rules += [(f"toward {p} programs", lambda n, k, p=p: split_toward(n, k, p)) for p in programs]

    def row(name: str, pdl: bool, ms: float) -> dict:
        return {"GEMMs": f"int4 mma.sync, {name}", "dependent launch": "on" if pdl else "off", "ms": f"{ms:.3f}",
                "x bf16": f"{bf16_ms / ms:.2f}", "int4 GB/s": f"{nbytes / ms / 1e6:.0f}",
                "% copy": f"{100 * nbytes / ms / 1e6 / ceiling:.0f}"}

    rows = [{"GEMMs": "bf16 torch.mm", "dependent launch": "-", "ms": f"{bf16_ms:.3f}", "x bf16": "1.00"}]
    if "--offset-after" in sys.argv:
        rows += offset_after_rows(layers, xs, row)
        print(table(rows))
        return
    if "--grid" in sys.argv:
        for (name, rule), stages in itertools.product(rules, depths):
            with dependent_launches(True):
                rows.append(row(f"tiled, {name}, {stages} stages", True, chain_ms(layers, xs, rule, True, stages)))
            print(rows[-1], flush=True)
        print(table(rows))
        return
    for pdl, tiled in ((True, False), (True, True), (False, False), (False, True)):
        for name, rule in rules:
            with dependent_launches(pdl):
                rows.append(row(f"{'tiled' if tiled else 'stored'}, {name}", pdl, chain_ms(layers, xs, rule, tiled)))
            print(rows[-1], flush=True)
    for stages in depths:
        with dependent_launches(True):
            rows.append(row(f"tiled, the product's split, {stages} stages", True,
                            chain_ms(layers, xs, rules[0][1], True, stages)))
        print(rows[-1], flush=True)
    with dependent_launches(True), weights_prefetched(True):
        rows.append(row("tiled, the product's split, first codes prefetched", True,
                        chain_ms(layers, xs, rules[0][1], True)))
    print(rows[-1], flush=True)
    print(f"{LAYERS} layers x {len(LAYER)} GEMMs at M = 1, one CUDA graph; int4 bytes (codes, lane scales, zero "
          f"points): {nbytes / 1e9:.2f} GB")
    print(table(rows))


if __name__ == "__main__":
    main()
