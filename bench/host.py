"""Host cost of the ops, and of a default-mode (no CUDA graphs) forward: where the CPU time of a launch goes.

Per op: microseconds of CPU per call at a tiny shape, where the GPU finishes each kernel before the next launch
is issued, so wall time per call is the host's cost. End to end: the 4-layer Llama of bench/e2e.py at decode B16,
default mode, with the kernel launches per forward and the Python functions that take the host's time.

Run: python -m bench.host [--no-e2e] [recipe ...]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from bench.common import header, table
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_weight_only import weight_only_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.numerics import reference as R

CALLS = 500


def host_us(fn) -> float:
    """CPU microseconds per call of fn(), the GPU kept ahead of the host."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / CALLS * 1e6


def profile_text(fn, calls: int, lines: int = 30) -> str:
    """The cProfile table of `calls` calls of fn(), by own time."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(lines)
    return out.getvalue()


@torch.library.custom_op("fxquant_bench::empty_custom_op", mutates_args=())
def empty_custom_op(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x)


@empty_custom_op.register_fake
def _(x, group):
    return torch.empty_like(x)


LIB = torch.library.Library("fxquant_bench", "FRAGMENT")
LIB.define("empty_library_op(Tensor x, int group) -> Tensor")
LIB.impl("empty_library_op", lambda x, group: torch.empty_like(x), "CUDA")


@triton.jit
def _one_arg_kernel(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 0.0)


def floor_rows() -> list[dict]:
    """What any op pays: the dispatcher's two registration paths and a bare Triton launch."""
    x = torch.randn(16, 16, device="cuda")
    cases = {
        "torch.empty_like": lambda: torch.empty_like(x),
        "custom_op returning empty_like": lambda: torch.ops.fxquant_bench.empty_custom_op(x, 0),
        "Library op returning empty_like": lambda: torch.ops.fxquant_bench.empty_library_op(x, 0),
        "Triton launch, one argument": lambda: _one_arg_kernel[(1,)](x),
    }
    return [{"call": name, "host us": f"{host_us(fn):.1f}"} for name, fn in cases.items()]


def op_rows() -> list[dict]:
    m, n, k = 1, 256, 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    w = R.quantize(wb, "fp8_e4m3", ("block", 128, 128))
    a, a_scale = quantize_fp8_rows(x, 128)
    q4 = R.quantize(wb.float(), "int4", ("group", 128))
    norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.fxquant
    cases = {
        "torch.mm bf16 (cuBLAS)": lambda: torch.mm(x, wb.T),
        "torch.empty": lambda: torch.empty((m, n), device="cuda"),
        "quantize_fp8_rows (kernel wrapper)": lambda: quantize_fp8_rows(x, 128),
        "fxquant::quantize_fp8": lambda: ops.quantize_fp8(x, 128),
        "fp8_scaled_mm (kernel wrapper, split-K)": lambda: fp8_scaled_mm(a, a_scale, w.data, w.scale),
        "fxquant::scaled_mm_fp8": lambda: ops.scaled_mm_fp8(a, a_scale, w.data, w.scale, None, torch.bfloat16),
        "fxquant::linear_fp8": lambda: ops.linear_fp8(x, w.data, w.scale, None, 128),
        "fxquant::norm_quant_fp8": lambda: ops.norm_quant_fp8(x, norm_w, None, 1e-6, 128, True),
        "fxquant::add_norm_quant_fp8": lambda: ops.add_norm_quant_fp8(x, x, norm_w, None, 1e-6, 128, True),
        "weight_only_mm int4 (kernel wrapper)": lambda: weight_only_mm(x, q4.data, q4.scale, "int4", 128, n,
                                                                       zero_point=q4.zero_point),
    }
    rows = [{"call": name, "host us": f"{host_us(fn):.1f}"} for name, fn in cases.items()]
    print(profile_text(cases["fxquant::linear_fp8"], 200))
    return rows


def e2e_rows(recipes) -> list[dict]:
    from bench.e2e import build

    model = build()
    ids = torch.randint(0, 32000, (16, 1), device="cuda")
    rows = []
    with torch.no_grad():
        for path in ["inductor bf16", *recipes]:
            torch._dynamo.reset()
            if path == "inductor bf16":
                fn = torch.compile(model)
            else:
                fn = torch.compile(model, backend="fxquant", options={"recipe": path})
            call = lambda fn=fn: fn(ids, use_cache=False)
            call()
            wall = host_us(call) / 1e3
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    call()
                torch.cuda.synchronize()
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.device_time_total > 0) / 10
            gpu = sum(e.self_device_time_total for e in events) / 10 / 1e3
            rows.append({"path": path, "decode B16 ms": f"{wall:.2f}", "GPU kernel ms": f"{gpu:.2f}",
                         "kernels per call": f"{launches:.0f}"})
            print(rows[-1], flush=True)
            print(f"--- {path}: cProfile of 20 calls, by own time")
            print(profile_text(call, 20, 40))
    return rows


def main():
    print(header())
    ops = floor_rows() + op_rows()
    recipes = [a for a in sys.argv[1:] if not a.startswith("--")] or ["fp8_block"]
    e2e = [] if "--no-e2e" in sys.argv else e2e_rows(recipes)
    print(table(ops))
    if e2e:
        print(table(e2e))


if __name__ == "__main__":
    main()
