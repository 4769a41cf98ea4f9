"""FP8 GEMMs on the GPU: correctness, an optional config sweep, then TFLOP/s and weight GB/s against
cuBLAS (torch._scaled_mm, torch.mm) measured in the same process.

Run: python -m bench.fp8_gemm [--sweep [--block]] [--decode | --medium | --large] [--merged]
(--medium: M in {64, 128} on the Llama and merged shapes, where the sweep tries split-K;
 --large: M in {1024, 4096} and 8192^3, where the sweep tries the persistent TMA kernel against cuBLAS)
"""

from __future__ import annotations

import sys

import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from fxquant.kernels.gemm_configs import fp8_gemm_config
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.numerics import reference as R

MS = ([1, 16] if "--decode" in sys.argv else [64, 128] if "--medium" in sys.argv
      else [1024, 4096] if "--large" in sys.argv else [1, 16, 128, 1024, 4096])
NKS = [(4096, 4096), (14336, 4096), (4096, 14336)]
MERGED = [(6144, 4096), (28672, 4096)]  # the shapes merge_linear makes of a Llama layer: q/k/v and gate/up
if "--merged" in sys.argv:
    NKS = MERGED
elif "--medium" in sys.argv:
    NKS = NKS + MERGED
CASES = [(m, n, k) for n, k in NKS for m in MS] + ([(8192, 8192, 8192)] if "--large" in sys.argv else [])
SCHEMES = {"tensor": ("tensor", "tensor"), "row": ("token", "channel"), "block": (("group", 128), ("block", 128, 128))}
# Row-scaled accumulation variants: the compiler promotes every K step (default) or the kernel does it by hand.
VARIANTS = {"": None, " (promote by hand)": {"COMPILER_PROMOTES": False}}


def operands(m, n, k, scheme):
    ga, gw = SCHEMES[scheme]
    qa = R.quantize(torch.randn(m, k, device="cuda"), "fp8_e4m3", ga)
    qw = R.quantize(torch.randn(n, k, device="cuda") * 0.02, "fp8_e4m3", gw)
    return qa, qw


def check() -> list[dict]:
    rows = []
    for scheme in SCHEMES:
        for m, n, k in [(1, 4096, 4096), (100, 14336, 4096), (1024, 4096, 14336)]:
            qa, qw = operands(m, n, k, scheme)
            exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T
            for variant, cfg in VARIANTS.items():
                if variant and scheme == "block":
                    continue
                out = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.float32, cfg)
                rows.append({"scheme": scheme + variant, "M": m, "N": n, "K": k,
                             "rel_err_vs_fp64": f"{float((out.double() - exact).norm() / exact.norm()):.2e}"})
    return rows


def scaled_mm_baselines(qa, qw, scheme):
    """torch._scaled_mm (cuBLAS) on the same operands: w as [K, N] column-major, scales as cuBLAS wants."""
    wt = qw.data.t()
    if scheme == "tensor":
        return lambda: torch._scaled_mm(qa.data, wt, qa.scale, qw.scale, out_dtype=torch.bfloat16)
    if scheme == "row":
        sw = qw.scale.reshape(1, -1)
        return lambda: torch._scaled_mm(qa.data, wt, qa.scale, sw, out_dtype=torch.bfloat16)
    sa = qa.scale.t().contiguous().t()  # 1x128 scales outer-dim-major
    sw = qw.scale.t()  # [K/128, N/128]
    return lambda: torch._scaled_mm(qa.data, wt, sa, sw, out_dtype=torch.bfloat16)


def sweep_candidates(m):
    if m <= 16:  # split-K toward a program count, or narrow tiles and no split (no reduce launch)
        return [dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=s, programs=p,
                     SWAP_AB=False) for bn in (32, 64, 128) for s in (4, 6) for p in (264, 528, 1056)] + [
                dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=s, SPLIT_K=1,
                     SWAP_AB=False) for bn in (16, 32) for s in (4, 6)] + [
                # row scales: the operands swapped, the weight's rows as the MMA's M (wgmma with fp8 as stored)
                dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=s, programs=p,
                     SWAP_AB=True) for bn in (64, 128) for s in (4, 6) for p in (264, 528)]
    if m <= 128 and "--medium" in sys.argv:  # split-K toward a program count, as at decode
        return [dict(BLOCK_M=64, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, programs=p)
                for bn in (64, 128) for p in (132, 264, 528)]
    if m <= 128:
        return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=s)
                for bm in (32, 64) for bn in (64, 128) for s in (3, 5)]
    pointer = [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s)
               for w in (4, 8) for s in (3, 4, 5)] + [
               dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)]
    if "--large" not in sys.argv:
        return pointer
    tma = [dict(TMA=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=s)
           for bm, bn in ((128, 128), (128, 256), (256, 128)) for s in (3, 4, 5)]
    return pointer[:1] + tma


def sweep() -> list[dict]:
    """Every candidate per scheme, shape and M, each checked against the default tiles' product before it is timed;
    the default tiles' and cuBLAS's times beside the best."""
    rows = []
    for scheme in ("block",) if "--block" in sys.argv else ("block", "row"):
        for m, n, k in CASES:
            sets = rotating(lambda s=scheme: operands(m, n, k, s), (m + n) * k)  # weights read from HBM
            qa, qw = sets[0]
            want = fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.float32)
            gemm = lambda qa, qw, c: fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.bfloat16, c)
            default = graph_time_ms(lambda qa, qw: gemm(qa, qw, None), sets)
            best = None
            for cfg in sweep_candidates(m):
                run = lambda qa, qw, c=cfg: gemm(qa, qw, c)
                try:
                    err = float((run(qa, qw).float() - want).norm() / want.norm())
                    ms = graph_time_ms(run, sets)
                except Exception as exc:  # a config the compiler rejects (shared memory, tile shape) is skipped
                    print("  skip", cfg, type(exc).__name__)
                    continue
                if err > 1e-2:  # bf16 output rounding is 2^-9; anything larger is a wrong kernel
                    raise AssertionError(f"{scheme} M={m} {n}x{k} {cfg}: rel err {err:.2e}")
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            try:
                cublas = graph_time_ms(lambda qa, qw: scaled_mm_baselines(qa, qw, scheme)(), sets)
            except Exception:  # cuBLAS blockwise refuses some shapes
                cublas = float("nan")
            tflops = lambda ms: f"{2 * m * n * k / ms / 1e9:.0f}"
            rows.append({"scheme": scheme, "M": m, "N": n, "K": k, "default us": f"{default * 1e3:.1f}",
                         "best us": f"{best[0] * 1e3:.1f}", "best TF/s": tflops(best[0]),
                         "cublas TF/s": tflops(cublas), "best / cublas": f"{cublas / best[0]:.2f}",
                         "best": " ".join(f"{key}={v}" for key, v in best[1].items())})
            print(rows[-1], flush=True)
    return rows


def bench() -> list[dict]:
    ceiling = copy_bandwidth_gbs()
    print(f"copy ceiling (read+write): {ceiling:.0f} GB/s")
    rows = []
    for m, n, k in CASES:
        flops = 2 * m * n * k
        results = {}
        x_sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                   torch.randn(n, k, device="cuda", dtype=torch.bfloat16)), (m + n) * k * 2)
        results["bf16 mm"] = (graph_time_ms(lambda x, w: x @ w.T, x_sets), n * k * 2)
        for scheme in SCHEMES:
            sets = rotating(lambda s=scheme: operands(m, n, k, s), (m + n) * k)
            for variant, cfg in VARIANTS.items():
                if variant and (scheme != "row" or m > 128):  # past M = 128 the TMA kernel always lets it promote
                    continue
                results[f"fxq {scheme}{variant}"] = (graph_time_ms(
                    lambda qa, qw, c=cfg: fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None,
                                                        torch.bfloat16, c), sets), n * k)
            try:
                results[f"cublas {scheme}"] = (graph_time_ms(
                    lambda qa, qw, s=scheme: scaled_mm_baselines(qa, qw, s)(), sets), n * k)
            except Exception as exc:
                results[f"cublas {scheme}"] = (None, f"{type(exc).__name__}: {str(exc)[:40]}")
        lin_sets = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                                     operands(1, n, k, "block")[1]), (m * 2 + n) * k)
        results["fxq linear_fp8 block (quant+gemm)"] = (graph_time_ms(
            lambda x, qw: torch.ops.fxquant.linear_fp8(x, qw.data, qw.scale, None, 128), lin_sets), n * k)
        for name, (ms, wbytes) in results.items():
            if ms is None:
                rows.append({"M": m, "N": n, "K": k, "impl": name, "us": "-", "TFLOP/s": wbytes,
                             "weight GB/s": "-", "% copy": "-"})
                continue
            rows.append({"M": m, "N": n, "K": k, "impl": name, "us": f"{ms * 1e3:.1f}",
                         "TFLOP/s": f"{flops / ms / 1e9:.0f}", "weight GB/s": f"{wbytes / ms / 1e6:.0f}",
                         "% copy": f"{100 * wbytes / ms / 1e6 / ceiling:.0f}"})
        print(f"M={m} N={n} K={k}:", {r["impl"]: r["us"] for r in rows if (r["M"], r["N"], r["K"]) == (m, n, k)},
              flush=True)  # each case as it finishes, so a cut-short run keeps what it measured
    return rows


def main():
    print(header())
    print(table(check()))
    if "--sweep" in sys.argv:  # the sweep alone: it times the default tiles and cuBLAS too
        print(table(sweep()))
        return
    print("configs in use:", {m: fp8_gemm_config(m, 4096, 4096, True) for m in MS})
    print(table(bench()))


if __name__ == "__main__":
    main()
