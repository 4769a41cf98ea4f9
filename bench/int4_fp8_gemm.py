"""The W4A8 GEMM (int4 weights in groups of 128, e4m3 activations per token) on the GPU: correctness of the kernel and
of the cuBLAS route against the fp64 product, a sweep of the kernel's tiles (the cuBLAS route is the default past
M = 128), and time against bf16 cuBLAS (torch.mm) and fp8 cuBLAS (torch._scaled_mm with row scales, the fp8_row
recipe's GEMM) in the same process.

With --on-int4-mma, at M <= 8 on the Llama shapes: the W4A8 kernel at its decode tiles against the int4 mma.sync
kernel over the same operands (`gemm_int4_mma.int4_mma_mm` with e4m3 activations: the codes as fp16 pairs on the
fp16 MMA), the weight's codes in rows and in tiles, each against the fp64 product.

Run: python -m bench.int4_fp8_gemm [--sweep | --pair-order | --on-int4-mma] [--ms 1 16 128 1024 4096]
     (--pair-order: the kernel's default tiles at M <= 16 with K in codes.pair_order, as shipped, and in K order)
"""

from __future__ import annotations

import sys

import torch

from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from fxquant.kernels.code_tiles import tile_codes
from fxquant.kernels.gemm_int4_fp8 import GROUP, int4_fp8_config, int4_fp8_mm
from fxquant.kernels.gemm_int4_mma import MAX_M, int4_mma_mm, pack_lanes
from fxquant.kernels.gemm_weight_only import weight_operands
from fxquant.numerics import reference as R

MS = [int(v) for v in sys.argv[sys.argv.index("--ms") + 1:]] if "--ms" in sys.argv else [1, 16, 128, 1024, 4096]
NKS = [(4096, 4096), (14336, 4096), (4096, 14336), (6144, 4096), (28672, 4096)]  # Llama, then merged q/k/v, gate/up


def operands(m, n, k, symmetric=True):
    qa = R.quantize(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), "fp8_e4m3", "token")
    qw = R.quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, "int4", ("group", GROUP),
                    symmetric=symmetric)
    return qa, qw


def gemm(qa, qw, cfg=None):
    return int4_fp8_mm(qa.data, qa.scale, qw.data, qw.scale, qw.zero_point, None, torch.bfloat16, cfg)


def check() -> list[dict]:
    """Relative error against the fp64 product of the dequantized operands, both routes, both schemes."""
    rows = []
    for m, n, k in [(1, 4096, 4096), (16, 14336, 4096), (100, 4096, 14336), (1024, 6144, 4096)]:
        for symmetric in (True, False):
            qa, qw = operands(m, n, k, symmetric)
            exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
            for route, cfg in {"kernel": dict(CUBLAS=False), **({"cublas": None} if m > 128 else {})}.items():
                err = float((gemm(qa, qw, cfg).double() - exact).norm() / exact.norm())
                rows.append({"M": m, "N": n, "K": k, "symmetric": symmetric, "route": route,
                             "rel_err_vs_fp64": f"{err:.2e}"})
                if err > 1e-2:  # bf16 output rounding is 2^-9; anything larger is a wrong product
                    raise AssertionError(rows[-1])
    return rows


def candidates(m):
    if m <= 16:  # programs: the split-K target (0: no split)
        return [dict(BLOCK_M=16, BLOCK_N=bn, GROUP_M=1, num_warps=4, num_stages=s, programs=p)
                for bn in (32, 64, 128) for s in (3, 5) for p in (0, 264, 528, 1056)]
    if m <= 128:
        return [dict(BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=4, num_stages=s)
                for bm in (32, 64, 128) for bn in (64, 128) for s in (3, 4)]
    return [dict(CUBLAS=False, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, num_warps=w, num_stages=3)
            for bm, bn in ((128, 128), (128, 256), (256, 128)) for w in (4, 8)]


def baselines(m, n, k):
    """bf16 torch.mm and fp8 row-scaled torch._scaled_mm at the shape, ms."""
    bf16 = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                             torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (m + n) * k * 2)
    fp8 = rotating(lambda: (R.quantize(torch.randn(m, k, device="cuda"), "fp8_e4m3", "token"),
                            R.quantize(torch.randn(n, k, device="cuda"), "fp8_e4m3", "channel")), (m + n) * k)
    return (graph_time_ms(lambda x, w: x @ w.T, bf16),
            graph_time_ms(lambda qa, qw: torch._scaled_mm(qa.data, qw.data.t(), qa.scale, qw.scale.reshape(1, -1),
                                                          out_dtype=torch.bfloat16), fp8))


def sweep(do_sweep: bool) -> list[dict]:
    ceiling = copy_bandwidth_gbs() / 2  # read bandwidth
    rows = []
    for n, k in NKS:
        for m in MS:
            sets = rotating(lambda: operands(m, n, k), m * k + n * k // 2)
            qa, qw = sets[0]
            want = gemm(qa, qw).float()
            default = graph_time_ms(gemm, sets)
            best = (default, None)
            for cfg in candidates(m) if do_sweep else []:
                try:
                    err = float((gemm(qa, qw, cfg).float() - want).norm() / want.norm())
                    ms = graph_time_ms(lambda qa, qw, c=cfg: gemm(qa, qw, c), sets)
                except Exception as exc:  # a config the compiler rejects (shared memory, tile shape) is skipped
                    print("  skip", cfg, type(exc).__name__, str(exc)[:80], flush=True)
                    continue
                if err > 1e-2:
                    raise AssertionError(f"M={m} {n}x{k} {cfg}: rel err {err:.2e}")
                if ms < best[0]:
                    best = (ms, cfg)
            bf16, fp8 = baselines(m, n, k)
            weight_bytes = n * k // 2 + n * k // GROUP * 4
            rows.append({"M": m, "N": n, "K": k, "default us": f"{default * 1e3:.1f}",
                         "best us": f"{best[0] * 1e3:.1f}",
                         "TF/s": f"{2 * m * n * k / best[0] / 1e9:.0f}",
                         "weight % HBM": f"{100 * weight_bytes / best[0] / 1e6 / ceiling:.0f}",
                         "x bf16": f"{bf16 / best[0]:.2f}", "x fp8 cuBLAS": f"{fp8 / best[0]:.2f}",
                         "bf16 us": f"{bf16 * 1e3:.1f}", "fp8 us": f"{fp8 * 1e3:.1f}",
                         "best": "default" if best[1] is None else " ".join(f"{a}={v}" for a, v in best[1].items())})
            print(rows[-1], flush=True)
    return rows


def pair_order_ab() -> list[dict]:
    """The decode tiles (M <= 16) on the Llama shapes with both operands' K in codes.pair_order (int4_fp8_config's
    PAIR_ORDER, on by default there) and in K order: us and relative error against the fp64 product."""
    rows = []
    for n, k in NKS[:3]:
        for m in [m for m in MS if m <= 16]:
            row = {"M": m, "N x K": f"{n}x{k}"}
            sets = rotating(lambda: operands(m, n, k), m * k + n * k // 2)
            qa, qw = sets[0]
            exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
            for name, order in (("pairs", True), ("K order", False)):
                cfg = {**int4_fp8_config(m, n), "PAIR_ORDER": order}
                err = float((gemm(qa, qw, cfg).double() - exact).norm() / exact.norm())
                ms = graph_time_ms(lambda qa, qw, c=cfg: gemm(qa, qw, c), sets)
                row |= {f"{name} us": f"{ms * 1e3:.1f}", f"{name} err": f"{err:.1e}"}
            rows.append(row)
            print(row, flush=True)
    return rows


def on_int4_mma() -> list[dict]:
    """--on-int4-mma: us and relative error of the W4A8 kernel and of the int4 mma.sync kernel over e4m3
    activations (codes in rows, and in tiles), at M <= 8, against bf16 cuBLAS."""
    rows = []
    for n, k in NKS:
        for m in [m for m in MS if m <= MAX_M]:
            def mma_operands(tiled: bool):
                qa, qw = operands(m, n, k)
                like = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)  # weight_operands' activations
                codes, scale = weight_operands(like, tile_codes(qw.data) if tiled else qw.data, qw.scale, "int4",
                                               GROUP, n)
                return qa.data, qa.scale.reshape(m).float(), codes, pack_lanes(scale, None)[0], qa, qw
            row = {"M": m, "N x K": f"{n}x{k}", "bf16 us": f"{baselines(m, n, k)[0] * 1e3:.1f}"}
            sets = rotating(lambda: operands(m, n, k), m * k + n * k // 2)
            qa, qw = sets[0]
            exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
            row["W4A8 us"] = f"{graph_time_ms(gemm, sets) * 1e3:.1f}"
            row["W4A8 err"] = f"{float((gemm(qa, qw).double() - exact).norm() / exact.norm()):.1e}"
            for name, tiled in (("mma rows", False), ("mma tiles", True)):
                mma_sets = rotating(lambda t=tiled: mma_operands(t), m * k + n * k // 2)
                a, a_scale, codes, lane_scale, qa, qw = mma_sets[0]
                out = int4_mma_mm(a, codes, lane_scale, None, GROUP, a_scale=a_scale)
                exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
                ms = graph_time_ms(lambda a, s, c, ls, *_: int4_mma_mm(a, c, ls, None, GROUP, a_scale=s), mma_sets)
                row |= {f"{name} us": f"{ms * 1e3:.1f}",
                        f"{name} err": f"{float((out.double() - exact).norm() / exact.norm()):.1e}"}
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    print(header())
    if "--on-int4-mma" in sys.argv:
        print(table(on_int4_mma()))
        return
    if "--pair-order" in sys.argv:
        print(table(pair_order_ab()))
        return
    print(table(check()))
    print("default tiles:", {(m, n): int4_fp8_config(m, n) for m in MS for n in sorted({n for n, _ in NKS})})
    print(table(sweep("--sweep" in sys.argv)))


if __name__ == "__main__":
    main()
