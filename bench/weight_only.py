"""Weight-only GEMMs and the fused norm -> fp8 on the GPU: correctness first, then time against bf16 torch.mm
(cuBLAS) and the unfused norm + quantize, measured in the same process.

Run: PYTHONPATH=. python bench/weight_only.py [--sweep | --crossover] [--decode]
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from fxquant import reference as R
from fxquant.kernels import gemm_weight_only
from fxquant.kernels.gemm_weight_only import weight_only_mm, wo_gemm_config
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8

MS = [1, 16] if "--decode" in sys.argv else [1, 16, 128, 1024, 4096]  # --decode: the M <= 16 rows alone
NKS = [(4096, 4096), (14336, 4096), (4096, 14336)]
FORMATS = {"int8": ("channel", 0), "int4": (("group", 128), 128), "mxfp4": (None, 32), "nvfp4": (None, 16)}


def quantized_weight(n, k, fmt):
    gran, _ = FORMATS[fmt]
    w = torch.randn(n, k, device="cuda") * 0.02
    return R.quantize(w, fmt, gran) if gran else R.quantize(w, fmt)


def run(x, q, fmt, config=None):
    return weight_only_mm(x, q.data, q.scale, fmt, FORMATS[fmt][1], q.shape[0], zero_point=q.zero_point,
                          global_scale=q.global_scale, config=config)


def check() -> list[dict]:
    rows = []
    for fmt in FORMATS:
        for m, n, k in [(1, 4096, 4096), (16, 14336, 4096), (300, 4096, 14336)]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            q = quantized_weight(n, k, fmt)
            exact = x.double() @ R.dequantize(q, torch.float64).T
            err = float((run(x, q, fmt).double() - exact).norm() / exact.norm())
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
    return rows


def sweep_candidates(m):
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "programs", "maxnreg")
    if m <= 16:  # maxnreg 96: 5 programs of 128 threads per SM instead of the int4 kernel's 4 (bench/sass.py)
        grid = itertools.product([16], [32, 64, 128], [128], [1], [4], [3, 5], [528, 1056], [None, 96])
    else:
        grid = [(bm, bn, 128, 8, w, s, 264, None)
                for bm, bn, w in [(128, 128, 8), (128, 128, 4), (64, 128, 4), (128, 256, 8)] for s in (3, 4)]
    return [dict(zip(keys, values, strict=True)) for values in grid]


def timed(m, n, k, fmt, cfg):
    q = quantized_weight(n, k, fmt)
    sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16), _copy(q)), q.nbytes + m * k * 2)
    return graph_time_ms(lambda x, q: run(x, q, fmt, cfg), sets), q.nbytes


def sweep(ceiling) -> list[dict]:
    """Every candidate on the widest shape, then the five best of each on the other shapes and M."""
    rows = []
    for fmt, m_probe in itertools.product(("int4", "mxfp4", "int8"), [m for m in (16, 1024) if m <= MS[-1]]):
        ranked = []
        for cfg in sweep_candidates(m_probe):
            try:
                ranked.append((timed(m_probe, 14336, 4096, fmt, cfg)[0], cfg))
            except Exception as exc:  # a config the compiler rejects (shared memory, registers) is skipped
                print("  skip", fmt, cfg, type(exc).__name__, flush=True)
        ranked.sort(key=lambda r: r[0])
        for ms, cfg in ranked[:8]:
            print(f"  {fmt} M={m_probe} 14336x4096 {ms * 1e3:.1f} us {cfg}", flush=True)
        for (n, k), m in itertools.product(NKS, (1, 16) if m_probe == 16 else (1024, 4096)):
            best = min((timed(m, n, k, fmt, cfg) + (cfg,) for _, cfg in ranked[:5]), key=lambda r: r[0])
            rows.append({"format": fmt, "M": m, "N": n, "K": k, "us": f"{best[0] * 1e3:.1f}",
                         "% copy": f"{100 * best[1] / best[0] / 1e6 / ceiling:.0f}",
                         "best": " ".join(f"{key}={v}" for key, v in best[2].items())})
            print(rows[-1], flush=True)
    return rows


def crossover(ceiling) -> list[dict]:
    """Both large-M paths around DEQUANTIZE_ABOVE_M: in registers (its tile table) and dequantize + cuBLAS."""
    rows = []
    for (n, k), m, fmt in itertools.product(NKS[1:], (32, 64, 128, 256), ("int4", "mxfp4", "int8")):
        sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                 torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (m + n) * k * 2)
        bf16 = graph_time_ms(lambda x, w: x @ w.T, sets)
        registers, _ = timed(m, n, k, fmt, wo_gemm_config(min(m, 128), k, fmt))
        threshold, gemm_weight_only.DEQUANTIZE_ABOVE_M = gemm_weight_only.DEQUANTIZE_ABOVE_M, 0  # every M dequantizes
        dequantized, _ = timed(m, n, k, fmt, None)
        gemm_weight_only.DEQUANTIZE_ABOVE_M = threshold
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
        print(table(sweep(ceiling)))
        return
    if "--crossover" in sys.argv:
        print(table(crossover(ceiling)))
        return
    if "--decode" not in sys.argv:
        print(table(bench_norm(ceiling)))
    print(table(bench_gemms(ceiling)))


if __name__ == "__main__":
    main()
