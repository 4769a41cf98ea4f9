"""W4A8 past 128 rows, row-scaled against channel groups: the int4 codes made e4m3 with their groups' powers of two
(group scales in the row-scaled form, numerics/row_powers_of_two.py) and multiplied by cuBLAS's rowwise fp8 GEMM
(dense) or CUTLASS's grouped one (experts), against the same codes under amax group scales multiplied by cuBLAS's
1x128 block-scaled GEMM (dense) or the grouped Triton kernel that scales each K step's partial (experts), with
bf16 cuBLAS and fp8_row's stored-e4m3 GEMM in the same process.

Dense: Llama-3-8B's linears as the backend multiplies them (merged q/k/v and gate/up, o_proj, down_proj). Experts:
Mixtral-8x7B's, top-2 rows sorted by expert (`bench.grouped_tiles`' operands), in a CUDA graph. Each route's
product is checked against the fp64 product of its dequantized operands before it is timed.

--convert: the codes made e4m3 alone (row-scaled), with the copy bandwidth they reach.

Run: python -m bench.int4_fp8_rows [--ms 1024 4096] [--tokens 4096] [--convert]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from bench.grouped_tiles import EXPERTS, operands
from bench.grouped_tiles import SHAPES as EXPERT_SHAPES
from bench.moe import graph_output
from fxquant.kernels.gemm_grouped import grouped_fp8_mm, grouped_int4_fp8_mm
from fxquant.kernels.gemm_int4_fp8 import GROUP, int4_as_e4m3, int4_fp8_mm
from fxquant.numerics import reference as R
from fxquant.numerics.row_powers_of_two import SCALE_MODE

SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
CEILING = 1e-2  # bf16 output rounding is 2^-9 of each element; a wrong product is off by far more


def int4_weight(w: torch.Tensor, rows: bool):
    """w's symmetric int4 codes in groups of 128: amax group scales, or (rows) the row-scaled form."""
    return R.quantize(w, "int4", ("group", GROUP), symmetric=True, scale_mode=SCALE_MODE if rows else None)


def dense_routes(qa, qw_amax, qw_rows, w_fp8) -> dict:
    """name -> the product's callable, on one operand set."""
    m = qa.data.shape[0]
    w4a8 = lambda qw, rows: int4_fp8_mm(qa.data, qa.scale, qw.data, qw.scale, None, None, torch.bfloat16,
                                        row_scale=qw.row_scale if rows else None)
    return {
        "fp8_row (e4m3 weight)": lambda: torch._scaled_mm(qa.data, w_fp8.data.t(), qa.scale.reshape(m, 1),
                                                          w_fp8.scale.reshape(1, -1), out_dtype=torch.bfloat16),
        "W4A8 block-scaled": lambda: w4a8(qw_amax, False),
        "W4A8 row-scaled": lambda: w4a8(qw_rows, True),
        "codes to e4m3 alone": lambda: int4_as_e4m3(qw_rows.data, None, qw_rows.scale, qw_rows.row_scale),
    }


def exact_product(qa, qw) -> torch.Tensor:
    return R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def dense_rows(ms: list[int], device: str = "cuda") -> list[dict]:
    rows = []
    for (name, (n, k)), m in ((s, m) for s in SHAPES.items() for m in ms):
        def make():
            w = torch.randn(n, k, device=device) * 0.02
            return (R.quantize(torch.randn(m, k, device=device, dtype=torch.bfloat16), "fp8_e4m3", "token"),
                    int4_weight(w, False), int4_weight(w, True), R.quantize(w, "fp8_e4m3", "channel"))
        sets = rotating(make, m * k + n * k * 3 // 2)
        checks = {"W4A8 block-scaled": sets[0][1], "W4A8 row-scaled": sets[0][2]}
        for route, qw in checks.items():
            error = rel_error(dense_routes(*sets[0])[route](), exact_product(sets[0][0], qw))
            if error > CEILING:
                raise SystemExit(f"M {m} {name}: {route} is off the fp64 product by {error:.3g}")
        bf16 = rotating(lambda: (torch.randn(m, k, device=device, dtype=torch.bfloat16),
                                 torch.randn(n, k, device=device, dtype=torch.bfloat16)), (m + n) * k * 2)
        bf16_us = 1e3 * graph_time_ms(lambda x, w: x @ w.T, bf16)
        row = {"M": m, "GEMM": f"{name} {n}x{k}", "bf16 us": f"{bf16_us:.0f}"}
        for route in dense_routes(*sets[0]):
            us = 1e3 * graph_time_ms(lambda *ops, r=route: dense_routes(*ops)[r](), sets)
            row[route] = f"{us:.0f} us, {bf16_us / us:.2f}x"
        rows.append(row)
        print(row, flush=True)
    return rows


def convert_rows(ceiling: float) -> list[dict]:
    """The row-scaled codes made e4m3 alone on each Llama linear and Mixtral's stacked experts, with the copy
    bandwidth they reach (int4 codes and scales read, e4m3 codes written)."""
    rows = []
    shapes = {**{f"{name} {n}x{k}": (1, n, k) for name, (n, k) in SHAPES.items()},
              **{f"experts {name} {n}x{k}": (EXPERTS, n, k) for name, (n, k) in EXPERT_SHAPES.items()}}
    for name, (e, n, k) in shapes.items():
        qw = R.stack_experts([int4_weight(torch.randn(n, k, device="cuda") * 0.02, True) for _ in range(e)])
        convert = lambda: int4_as_e4m3(qw.data, None, qw.scale, qw.row_scale)
        nbytes = qw.data.nbytes + qw.scale.nbytes + qw.row_scale.nbytes + convert().nbytes
        us = 1e3 * graph_time_ms(convert, [()])
        rows.append({"weight": name, "MB moved": f"{nbytes / 1e6:.0f}", "us": f"{us:.1f}",
                     "% copy": f"{100 * nbytes / us / 1e3 / ceiling:.0f}"})
        print(rows[-1], flush=True)
    return rows


def expert_rows(tokens_list: list[int]) -> list[dict]:
    """Mixtral's experts in a CUDA graph: bf16 grouped_mm, fp8_row's grouped GEMM, W4A8 over channel groups (the
    grouped Triton kernel) and row-scaled (CUTLASS)."""
    rows = []
    for tokens, (name, (n, k)) in ((t, s) for t in tokens_list for s in EXPERT_SHAPES.items()):
        x, a, a_scale, offs, _ = operands(tokens, n, k)
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        amax, rowed = (R.stack_experts([int4_weight(w[e], rows) for e in range(EXPERTS)]) for rows in (False, True))
        fp8 = R.quantize_experts(w, "fp8_e4m3", "channel")
        rowed_mm = lambda: grouped_int4_fp8_mm(a, a_scale, offs, rowed.data, rowed.scale, None,
                                               row_scale=rowed.row_scale)
        routes = {
            "bf16 grouped_mm": lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
            "fp8_row (e4m3 experts)": lambda: grouped_fp8_mm(a, a_scale, offs, fp8.data, fp8.scale),
            "W4A8 channel groups": lambda: grouped_int4_fp8_mm(a, a_scale, offs, amax.data, amax.scale, None),
            "W4A8 row-scaled": rowed_mm,
        }
        exact = a.double() * a_scale.double()
        row = {"tokens": tokens, "GEMM": f"{name} {n}x{k}"}
        base = None
        for route, fn in routes.items():
            qw = {"W4A8 channel groups": amax, "W4A8 row-scaled": rowed}.get(route)
            if qw is not None:
                weights = R.dequantize_experts(qw, torch.float64)
                want = torch.cat([exact[s] @ weights[e].T for e, s in R.expert_rows(offs)])
                error = rel_error(graph_output(fn, ())[:want.shape[0]], want)
                if error > CEILING:
                    raise SystemExit(f"{tokens} tokens {name}: {route} is off the fp64 product by {error:.3g}")
            us = 1e3 * graph_time_ms(fn, [()])
            base = base or us
            row[route] = f"{us:.0f} us, {base / us:.2f}x"
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, nargs="*", default=[4096])
    parser.add_argument("--convert", action="store_true")
    args = parser.parse_args()
    print(header())
    if args.convert:
        ceiling = copy_bandwidth_gbs()
        with torch.no_grad():
            rows = convert_rows(ceiling)
        print(f"\nthe codes made e4m3 (row-scaled), us and % of the copy bandwidth ({ceiling:.0f} GB/s)")
        print(table(rows))
        return
    with torch.no_grad():
        dense = dense_rows(args.ms)
        experts = expert_rows(args.tokens)
    print("\nLlama-3-8B's linears, us and x bf16 cuBLAS (CUDA graph replay)")
    print(table(dense))
    if experts:
        print("\nMixtral-8x7B's experts, top-2 rows sorted by expert, us and x bf16 grouped_mm (CUDA graph replay)")
        print(table(experts))


if __name__ == "__main__":
    main()
