"""Weight-only GEMMs and the fused norm -> fp8 on the GPU: correctness first, then time against bf16 torch.mm
(cuBLAS) and the unfused norm + quantize, measured in the same process.

Run: python -m bench.weight_only [--sweep | --crossover | --pair-order] [--decode | --medium]
     (--pair-order: the shipped tiles with packed 4-bit operands in codes.pair_order and in K order, M = 1, 16, 32)
The 4-bit formats also run through their lanes ops, as the backend gives them on the GPU: at M = 1 the mma.sync
kernels.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from fxquant.kernels import gemm_weight_only
from fxquant.kernels.gemm_fp4_mma import pack_fp4_lanes
from fxquant.kernels.gemm_int4_mma import pack_lanes
from fxquant.kernels.gemm_weight_only import weight_only_mm, wo_gemm_config
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
from fxquant.numerics import reference as R

# --decode: the M <= 16 rows alone; --medium: M = 32, 64, 128
MS = [1, 16] if "--decode" in sys.argv else [32, 64, 128] if "--medium" in sys.argv else [1, 16, 128, 1024, 4096]
NKS = [(4096, 4096), (14336, 4096), (4096, 14336)]
FORMATS = {"int8": ("channel", 0), "int4": (("group", 128), 128), "mxfp4": (None, 32), "nvfp4": (None, 16),
           "mxfp8": (None, 32)}


def quantized_weight(n, k, fmt):
    gran, _ = FORMATS[fmt]
    w = torch.randn(n, k, device="cuda") * 0.02
    return R.quantize(w, fmt, gran) if gran else R.quantize(w, fmt)


def run(x, q, fmt, config=None):
    return weight_only_mm(x, q.data, q.scale, fmt, FORMATS[fmt][1], q.shape[0], zero_point=q.zero_point,
                          global_scale=q.global_scale, config=config)


LANES = ("int4", "mxfp4", "nvfp4")  # the formats with a lanes op


def lanes_of(q):
    """The per-lane copies a lanes op takes: int4's scales and zero points, FP4's scales."""
    return pack_lanes(q.scale, q.zero_point) if q.fmt == "int4" else (pack_fp4_lanes(q.scale, q.fmt),)


def run_lanes(x, q, *lanes):
    """A 4-bit weight through its lanes op, as the backend puts it on 4-bit weights: at M = 1 the mma.sync kernel."""
    if q.fmt == "int4":
        return torch.ops.fxquant.linear_int4_lanes(x, q.data, q.scale, q.zero_point, *lanes, None, 128, q.shape[0])
    return torch.ops.fxquant.linear_fp4_lanes(x, q.data, q.scale, q.global_scale, *lanes, None, q.fmt,
                                              FORMATS[q.fmt][1], q.shape[0])


def check() -> list[dict]:
    rows = []
    for fmt in [*FORMATS, *(f"{name} lanes" for name in LANES)]:
        for m, n, k in [(1, 4096, 4096), (16, 14336, 4096), (300, 4096, 14336)]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q = quantized_weight(n, k, fmt.split()[0])
            exact = x.double() @ R.dequantize(q, torch.float64).T
            out = run_lanes(x, q, *lanes_of(q)) if fmt.endswith("lanes") else run(x, q, fmt)
            err = float((out.double() - exact).norm() / exact.norm())
            rows.append({"format": fmt, "M": m, "N": n, "K": k, "rel_err_vs_fp64": f"{err:.2e}"})
    return rows


def bench_gemms(ceiling) -> list[dict]:
    rows = []
    for n, k in NKS:
        for m in MS:
            sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                     torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (m + n) * k * 2)
            bf16 = graph_time_ms(lambda x, w: x @ w.T, sets)
            rows.append(_row(m, n, k, "bf16 mm", bf16, bf16, n * k * 2, ceiling))
            for fmt in FORMATS:
                q = quantized_weight(n, k, fmt)
                wsets = rotating(lambda q=q: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                              _copy(q)), q.nbytes + m * k * 2)
                ms = graph_time_ms(lambda x, q, f=fmt: run(x, q, f), wsets)
                rows.append(_row(m, n, k, f"fxq {fmt}", ms, bf16, q.nbytes, ceiling))
            for fmt in LANES:
                q = quantized_weight(n, k, fmt)
                lsets = rotating(lambda q=q: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), _copy(q),
                                              *lanes_of(q)), q.nbytes + m * k * 2)
                ms = graph_time_ms(run_lanes, lsets)
                op = "linear_int4_lanes" if fmt == "int4" else "linear_fp4_lanes"
                rows.append(_row(m, n, k, f"fxq {fmt}, {op}", ms, bf16, q.nbytes, ceiling))
    return rows


def decode_candidates() -> list[dict]:
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "programs")
    grid = itertools.product([16], [32, 64, 128], [128], [1], [4], [3, 5], [528, 1056])
    return [dict(zip(keys, values, strict=True)) for values in grid]


# Medium-M tiles, each splitting K toward its program count (p) where the output tiles are fewer; w: warps.
MEDIUM_CANDIDATES = {f"{bm}x{bn} w{w} p{p}": dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w,
                                                   num_stages=3, programs=p)
                     for bm, bn, w, p in [(16, 64, 4, 528), (32, 64, 4, 264), (64, 64, 4, 264), (64, 128, 4, 264),
                                          (32, 128, 4, 264), (128, 128, 8, None), (128, 128, 8, 132),
                                          (128, 128, 8, 264), (128, 64, 8, 264), (64, 128, 8, 264)]}


def timed(m, n, k, fmt, cfg, q=None):
    q = q if q is not None else quantized_weight(n, k, fmt)
    sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), _copy(q)), q.nbytes + m * k * 2)
    return graph_time_ms(lambda x, q: run(x, q, fmt, cfg), sets), q.nbytes


def sweep(ceiling) -> list[dict]:
    """Decode: every candidate on the widest shape, then the five best of each on the other shapes and M."""
    rows = []
    for fmt in ("int4", "mxfp4", "int8"):
        ranked = []
        for cfg in decode_candidates():
            try:
                ranked.append((timed(16, 14336, 4096, fmt, cfg)[0], cfg))
            except Exception as exc:  # a config the compiler rejects (shared memory, registers) is skipped
                print("  skip", fmt, cfg, type(exc).__name__, flush=True)
        ranked.sort(key=lambda r: r[0])
        for ms, cfg in ranked[:8]:
            print(f"  {fmt} M=16 14336x4096 {ms * 1e3:.1f} us {cfg}", flush=True)
        for (n, k), m in itertools.product(NKS, (1, 16)):
            best = min((timed(m, n, k, fmt, cfg) + (cfg,) for _, cfg in ranked[:5]), key=lambda r: r[0])
            rows.append({"format": fmt, "M": m, "N": n, "K": k, "us": f"{best[0] * 1e3:.1f}",
                         "% copy": f"{100 * best[1] / best[0] / 1e6 / ceiling:.0f}",
                         "best": " ".join(f"{key}={v}" for key, v in best[2].items())})
            print(rows[-1], flush=True)
    return rows


def sweep_medium() -> list[dict]:
    """M = 32, 64, 128: every medium candidate on every shape, beside the shipped dispatch, the dequantize + cuBLAS
    path and bf16 torch.mm (us). A candidate whose error against the fp64 product exceeds 1e-2, or whose tile is
    more than twice M, shows as nan."""
    rows = []
    for (n, k), m, fmt in itertools.product(NKS, (32, 64, 128), ("int4", "mxfp4", "int8")):
        q = quantized_weight(n, k, fmt)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        exact = x.double() @ R.dequantize(q, torch.float64).T
        sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (m + n) * k * 2)
        row = {"format": fmt, "M": m, "N x K": f"{n}x{k}", "bf16": graph_time_ms(lambda x, w: x @ w.T, sets),
               "shipped": timed(m, n, k, fmt, None, q)[0], "dequantized": _dequantized_ms(m, n, k, fmt, q)}
        for name, cfg in MEDIUM_CANDIDATES.items():
            if cfg["BLOCK_M"] > 2 * m:  # mostly padding
                row[name] = float("nan")
                continue
            err = float((run(x, q, fmt, cfg).double() - exact).norm() / exact.norm())
            row[name] = timed(m, n, k, fmt, cfg, q)[0] if err < 1e-2 else float("nan")
        best = min(MEDIUM_CANDIDATES, key=lambda c: row[c] if row[c] == row[c] else float("inf"))
        rows.append({key: (f"{v * 1e3:.1f}" if isinstance(v, float) else v) for key, v in row.items()} | {"best": best})
        print(rows[-1], flush=True)
    return rows


def pair_order_ab(ceiling) -> list[dict]:
    """Each packed format's shipped tile at M = 1, 16, 32 on every shape, its operands in codes.pair_order (off in
    the shipped tiles) and in K order: us, % of the copy ceiling on the weight's bytes, and error against fp64."""
    rows = []
    for (n, k), m, fmt in itertools.product(NKS, (1, 16, 32), ("int4", "mxfp4", "nvfp4")):
        q = quantized_weight(n, k, fmt)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        exact = x.double() @ R.dequantize(q, torch.float64).T
        row = {"format": fmt, "M": m, "N x K": f"{n}x{k}"}
        for name, order in (("pairs", True), ("K order", False)):
            cfg = {**wo_gemm_config(m, k, fmt), "PAIR_ORDER": order}
            err = float((run(x, q, fmt, cfg).double() - exact).norm() / exact.norm())
            ms, nbytes = timed(m, n, k, fmt, cfg, q)
            row |= {f"{name} us": f"{ms * 1e3:.1f}", f"{name} % copy": f"{100 * nbytes / ms / 1e6 / ceiling:.0f}",
                    f"{name} err": f"{err:.1e}"}
        rows.append(row)
        print(row, flush=True)
    return rows


def _dequantized_ms(m, n, k, fmt, q):
    threshold, gemm_weight_only.DEQUANTIZE_ABOVE_M = gemm_weight_only.DEQUANTIZE_ABOVE_M, 0  # every M dequantizes
    gemm_weight_only._launch_plan.cache_clear()
    try:
        return timed(m, n, k, fmt, None, q)[0]
    finally:
        gemm_weight_only.DEQUANTIZE_ABOVE_M = threshold
        gemm_weight_only._launch_plan.cache_clear()


def crossover(ceiling) -> list[dict]:
    """Both large-M paths around DEQUANTIZE_ABOVE_M: in registers (its tile table) and dequantize + cuBLAS."""
    rows = []
    for (n, k), m, fmt in itertools.product(NKS[1:], (32, 64, 128, 256), ("int4", "mxfp4", "int8")):
        sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (m + n) * k * 2)
        bf16 = graph_time_ms(lambda x, w: x @ w.T, sets)
        q = quantized_weight(n, k, fmt)
        registers, _ = timed(m, n, k, fmt, wo_gemm_config(min(m, 128), k, fmt), q)
        dequantized = _dequantized_ms(m, n, k, fmt, q)
        rows.append({"M": m, "N": n, "K": k, "format": fmt, "bf16 us": f"{bf16 * 1e3:.1f}",
                     "in registers us": f"{registers * 1e3:.1f}", "dequantize + cuBLAS us": f"{dequantized * 1e3:.1f}"})
        print(rows[-1], flush=True)
    return rows


def _copy(q):
    clone = lambda t: None if t is None else t.clone()
    return type(q)(q.data.clone(), q.scale.clone(), q.fmt, q.granularity, q.shape, q.dtype,
                   clone(q.global_scale), clone(q.zero_point), q.scale_mode)


def _row(m, n, k, impl, ms, bf16_ms, weight_bytes, ceiling):
    return {"M": m, "N": n, "K": k, "impl": impl, "us": f"{ms * 1e3:.1f}", "x bf16": f"{bf16_ms / ms:.2f}",
            "TFLOP/s": f"{2 * m * n * k / ms / 1e9:.0f}", "weight GB/s": f"{weight_bytes / ms / 1e6:.0f}",
            "% copy": f"{100 * weight_bytes / ms / 1e6 / ceiling:.0f}"}


def bench_norm(ceiling) -> list[dict]:
    rows = []
    for m, d in [(16, 4096), (1024, 4096), (8192, 4096)]:
        sets = rotating(lambda: (torch.randn(m, d, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(m, d, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(d, device="cuda", dtype=torch.bfloat16)), m * d * 4)
        io = m * d * (2 + 2 + 2 + 1) + m * (d // 128) * 4  # x, residual in; sum, codes, scales out

        def unfused(x, r, w):
            h = x + r
            y = F.rms_norm(h.float(), (d,), w.float(), 1e-6).to(torch.bfloat16)
            return torch.ops.fxquant.quantize_fp8(y, 128), h

        for name, fn in [("add+rms_norm+quant (torch + fxq quant)", unfused),
                         ("fxq add_norm_quant_fp8 (fused)",
                          lambda x, r, w: norm_quant_fp8(x, w, None, 1e-6, 128, residual=r))]:
            ms = graph_time_ms(fn, sets)
            rows.append({"M": m, "D": d, "impl": name, "us": f"{ms * 1e3:.1f}", "GB/s": f"{io / ms / 1e6:.0f}",
                         "% copy": f"{100 * io / ms / 1e6 / ceiling:.0f}"})
    return rows


def main():
    print(header())
    print(table(check()))
    ceiling = copy_bandwidth_gbs()
    print(f"copy ceiling (read+write): {ceiling:.0f} GB/s")
    if "--sweep" in sys.argv:
        print(table(sweep_medium() if "--medium" in sys.argv else sweep(ceiling)))
        return
    if "--pair-order" in sys.argv:
        print(table(pair_order_ab(ceiling)))
        return
    if "--crossover" in sys.argv:
        print(table(crossover(ceiling)))
        return
    if "--decode" not in sys.argv and "--medium" not in sys.argv:
        print(table(bench_norm(ceiling)))
    print(table(bench_gemms(ceiling)))


if __name__ == "__main__":
    main()
