"""The MXFP4 and NVFP4 mma.sync decode GEMM at M = 1 by its K split and pipeline depth: each Llama-3-8B shape alone,
read from HBM (rotating weights), against bf16 torch.mm; then the 32-layer chain of `bench.fp4_chain` with the small
weights (q/k/v and o) at the splits given, the others at the product's (`int4_mma_split`).

Alone, 4096x4096 is the shape that misses 1.8x bf16 (BENCHMARKS.md): the FP4 kernel spends more instructions a K step
than int4's, whose split rule it shares, so more, shorter programs may hide more of them. A split wins only where the
chain, as the step runs it (dependent launch on), wins too.

Run: python -m bench.fp4_split [--splits 8 10 12 16 20 24 32] [--stages 2 3 4] [--chain-splits 12 16 20]
"""

from __future__ import annotations

import torch
import triton.testing

from bench.common import graph_time_ms, header, rotating, table, values_after
from bench.fp4_chain import fp4_weight
from bench.int4_chain import LAYER, LAYERS, bf16_chain_ms
from fxquant.kernels.dependent_launch import dependent_launches
from fxquant.kernels.gemm_fp4_mma import BLOCKS, fp4_mma_mm
from fxquant.kernels.gemm_int4_mma import int4_mma_split
from fxquant.numerics import reference as R

SMALL = {(6144, 4096), (4096, 4096)}  # q/k/v and o: the weights whose split is varied
DEVICE = "cuda"


def relative_error(x, weight: dict, fmt: str, split: int, stages: int) -> float:
    """One product at a split and depth against the fp64 product of the dequantized weight."""
    exact = x.double() @ R.dequantize(weight["q"], torch.float64).T
    got = fp4_mma_mm(x, weight["tiles"], weight["lanes"], fmt, weight["q"].global_scale, split=split,
                     stages=stages).double()
    return float((got - exact).norm() / exact.norm())


def alone(fmt: str, n: int, k: int, splits: list[int], stages: list[int]) -> list[dict]:
    """One shape's bf16 time and the FP4 kernel's at each (split, stages), each timed over weights that rotate
    through more than the L2 holds; the product's split first."""
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    bf16 = rotating(lambda: torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16), n * k * 2)
    bf16_ms = graph_time_ms(lambda w: x @ w.T, [(w,) for w in bf16])
    del bf16
    first = fp4_weight(n, k, fmt)
    copies = len(rotating(lambda: None, first["tiles"].nbytes))  # how many weights rotate past the L2
    sets = [(first,)] + [(fp4_weight(n, k, fmt),) for _ in range(copies - 1)]
    product_split = int4_mma_split(n, k)
    rows = []
    for split in dict.fromkeys([product_split, *splits]):
        for depth in stages:
            error = relative_error(x, first, fmt, split, depth)
            row = {"format": fmt, "N x K": f"{n}x{k}", "split": split if split != product_split
                   else f"{split} (product)", "stages": depth, "rel err": f"{error:.1e}"}
            if error < 1e-2:  # fp32 sums of exact products, rounded once to bf16
                ms = graph_time_ms(lambda w, s=split, d=depth: fp4_mma_mm(x, w["tiles"], w["lanes"], fmt,
                                                                          w["q"].global_scale, split=s, stages=d), sets)
                row.update({"us": f"{ms * 1e3:.1f}", "x bf16": f"{bf16_ms / ms:.2f}"})
            else:  # reported and not timed; the run goes on to the other splits and fails at its end
                row["us"] = "WRONG"
            rows.append(row)
            print(row, flush=True)
    return rows


def chain(fmt: str, xs: dict, bf16_ms: float, chain_splits: list[int]) -> list[dict]:
    """The 32-layer chain with q/k/v and o at each split given (None: the product's)."""
    layers = [[fp4_weight(n, k, fmt) for n, k in LAYER] for _ in range(LAYERS)]
    rows = []
    for small in [None, *chain_splits]:
        def run(small=small):
            for layer in layers:
                for (n, k), w in zip(LAYER, layer, strict=True):
                    fp4_mma_mm(xs[k], w["tiles"], w["lanes"], fmt, w["q"].global_scale,
                               split=small if small and (n, k) in SMALL else None)

        with dependent_launches(True):
            ms = triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median")
        rows.append({"format": fmt, "q/k/v and o split": small or "product", "ms": f"{ms:.3f}",
                     "x bf16": f"{bf16_ms / ms:.2f}"})
        print(rows[-1], flush=True)
    layers.clear()  # 32 layers' weights go before the next format's
    torch.cuda.empty_cache()
    return rows


def main():
    print(header())
    splits = [int(v) for v in values_after("--splits", (8, 10, 12, 16, 20, 24, 32))]
    stages = [int(v) for v in values_after("--stages", (3,))]
    chain_splits = [int(v) for v in values_after("--chain-splits", (12, 16, 20))]
    rows = []
    for fmt in BLOCKS:
        for n, k in LAYER:
            rows += alone(fmt, n, k, splits if (n, k) in SMALL else [], stages)
            torch.cuda.empty_cache()
    print(table(rows), flush=True)
    xs = {k: torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16) for k in sorted({k for _, k in LAYER})}
    bf16_ms = bf16_chain_ms(xs)
    torch.cuda.empty_cache()
    chained = [{"format": "bf16 torch.mm", "ms": f"{bf16_ms:.3f}", "x bf16": "1.00"}]
    for fmt in BLOCKS:
        chained += chain(fmt, xs, bf16_ms, chain_splits)
    print(f"{LAYERS} layers x {len(LAYER)} GEMMs at M = 1, codes in tiles, one CUDA graph, dependent launch on")
    print(table(chained))
    wrong = [row for row in rows if row["us"] == "WRONG"]
    if wrong:
        raise SystemExit(f"bench.fp4_split: {len(wrong)} products past the error bound (1e-2): {wrong}")


if __name__ == "__main__":
    main()
