"""The MXFP4 and NVFP4 decode GEMMs of 32 Llama-3-8B layers at M = 1, in one CUDA graph, as `bench.int4_chain` times
int4's: q/k/v, o, gate/up and down, each layer its own weights, against bf16 torch.mm over the same chain, with
dependent launch on (as the decode step runs).

Each format runs through the in-register weight-only GEMM (`gemm_weight_only`, what the backend runs today) and
through the mma.sync kernel (`gemm_fp4_mma`, the option fp4_lanes) over its codes in rows, as `quantize` packs them,
and in tiles (`code_tiles`), as the backend holds them under that option. The outputs of the first layer are checked
against the fp64 product first.

Run: python -m bench.fp4_chain
"""

from __future__ import annotations

import torch
import triton.testing

from bench.common import copy_bandwidth_gbs, header, table
from bench.int4_chain import LAYER, LAYERS, bf16_chain_ms
from fxquant.kernels.code_tiles import tile_codes
from fxquant.kernels.dependent_launch import dependent_launches
from fxquant.kernels.gemm_fp4_mma import BLOCKS, fp4_mma_mm, pack_fp4_lanes
from fxquant.kernels.gemm_weight_only import weight_only_mm, weight_operands
from fxquant.numerics import reference as R


def fp4_weight(n: int, k: int, fmt: str) -> dict:
    """Random codes of one format: as `quantize` makes them (q), as int32 words in rows and in tiles, and the scales
    packed per lane."""
    q = R.quantize(torch.randn(n, k, device="cuda") * 0.02, fmt)
    a = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
    rows, _ = weight_operands(a, q.data, q.scale, fmt, BLOCKS[fmt], n)
    tiles, _ = weight_operands(a, tile_codes(q.data), q.scale, fmt, BLOCKS[fmt], n)
    return dict(q=q, rows=rows, tiles=tiles, lanes=pack_fp4_lanes(q.scale, fmt))


def product(x, weight: dict, fmt: str, kernel: str):
    """x @ W.T by the in-register GEMM ("in-register") or the mma.sync kernel over "rows" or "tiles"."""
    q = weight["q"]
    if kernel == "in-register":
        return weight_only_mm(x, q.data, q.scale, fmt, BLOCKS[fmt], q.shape[0], global_scale=q.global_scale)
    return fp4_mma_mm(x, weight[kernel], weight["lanes"], fmt, q.global_scale)


def checked(xs, layer, fmt: str, kernel: str) -> float:
    """The largest relative error of one layer's four products against the fp64 product of the dequantized weight."""
    worst = 0.0
    for (_, k), weight in zip(LAYER, layer, strict=True):
        exact = xs[k].double() @ R.dequantize(weight["q"], torch.float64).T
        got = product(xs[k], weight, fmt, kernel).double()
        worst = max(worst, float((got - exact).norm() / exact.norm()))
    return worst


def main():
    print(header())
    ceiling = copy_bandwidth_gbs()
    print(f"copy ceiling (read+write): {ceiling:.0f} GB/s")
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in sorted({width for _, width in LAYER})}
    bf16_ms = bf16_chain_ms(xs)
    torch.cuda.empty_cache()
    rows = [{"GEMMs": "bf16 torch.mm", "ms": f"{bf16_ms:.3f}", "x bf16": "1.00"}]
    for fmt in BLOCKS:
        layers = [[fp4_weight(n, k, fmt) for n, k in LAYER] for _ in range(LAYERS)]
        nbytes = sum(w["rows"].nbytes + w["lanes"].nbytes for layer in layers for w in layer)
        for kernel in ("in-register", "rows", "tiles"):
            error = checked(xs, layers[0], fmt, kernel)
            assert error < 1e-2, f"{fmt} {kernel}: relative error {error:.2e} against the fp64 product"

            def run(kernel=kernel, layers=layers):
                for layer in layers:
                    for (_, k), weight in zip(LAYER, layer, strict=True):
                        product(xs[k], weight, fmt, kernel)

            with dependent_launches(True):
                ms = triton.testing.do_bench_cudagraph(run, rep=200, return_mode="median")
            name = "in-register GEMM" if kernel == "in-register" else f"mma.sync, codes in {kernel}"
            rows.append({"GEMMs": f"{fmt} {name}", "ms": f"{ms:.3f}", "x bf16": f"{bf16_ms / ms:.2f}",
                         "GB/s": f"{nbytes / ms / 1e6:.0f}", "% copy": f"{100 * nbytes / ms / 1e6 / ceiling:.0f}",
                         "rel err": f"{error:.1e}"})
            print(rows[-1], flush=True)
        del layers
        torch.cuda.empty_cache()
    print(f"{LAYERS} layers x {len(LAYER)} GEMMs at M = 1, one CUDA graph, dependent launch on; bytes: codes and "
          "the scales packed per lane")
    print(table(rows))


if __name__ == "__main__":
    main()
