"""fp8 activation quantizers on the GPU: bit-exactness against the reference, then GB/s against the copy ceiling.

With --silu: silu(gate) * up quantized per token (`silu_mul_quant`) over Llama-3-8B's 14336 columns, one program a
row, at 1 to 64 tokens (its bits are checked by tests/kernels/test_silu_mul_quant.py).

Run: python -m bench.quant [--silu]
"""

from __future__ import annotations

import sys

import torch

import fxquant
from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from fxquant.kernels.quant_fp8 import quantize_fp8_rows, quantize_fp8_static, quantize_fp8_tensor
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows

SHAPES = [(1, 4096), (16, 4096), (128, 4096), (1024, 4096), (4096, 4096), (16384, 4096), (4096, 14336)]


def check_bit_exact() -> int:
    """Mismatched codes and scales, kernel vs reference; prints the first few of each."""
    mismatches = 0
    for m, k in [(4096, 4096), (333, 14336), (17, 256)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 40
        for gran in ["token", ("group", 128), "tensor"]:
            a = fxquant.quantize(x, "fp8_e4m3", gran, impl="triton")
            b = fxquant.quantize(x, "fp8_e4m3", gran, impl="reference")
            bad_codes = (a.data.view(torch.uint8) != b.data.view(torch.uint8)).nonzero()
            bad_scales = (a.scale != b.scale).nonzero()
            mismatches += len(bad_codes) + len(bad_scales)
            for idx in bad_codes[:3].tolist():
                print(f"  {m}x{k} {gran} code at {idx}: x={x[tuple(idx)].item()!r} "
                      f"ours={a.data[tuple(idx)].float().item()} ref={b.data[tuple(idx)].float().item()}")
            for idx in bad_scales[:3].tolist():
                print(f"  {m}x{k} {gran} scale at {idx}: ours={a.scale[tuple(idx)].item()!r} "
                      f"ref={b.scale[tuple(idx)].item()!r}")
    return mismatches


def silu_rows(width: int = 14336, tokens=(1, 16, 32, 64)) -> None:
    """us a call of the gated-MLP quantizer over `tokens` tokens' rows of `width`, each from a CUDA graph, and its
    share of the copy bandwidth on the bytes it moves (bf16 gate and up in, e4m3 codes out)."""
    ceiling = copy_bandwidth_gbs()
    rows = []
    for m in tokens:
        args = rotating(lambda m=m: tuple(torch.randn(2, m, width, device="cuda", dtype=torch.bfloat16)), 4 * m * width)
        ms = graph_time_ms(lambda g, u: silu_mul_quantize_fp8_rows(g, u, width), args)
        gbs = 5 * m * width / ms / 1e6
        rows.append({"tokens": m, "width": width, "us": f"{ms * 1e3:.2f}", "GB/s": f"{gbs:.0f}",
                     "% copy": f"{100 * gbs / ceiling:.0f}"})
        print(rows[-1], flush=True)
    print(table(rows))


def main():
    print(header())
    if "--silu" in sys.argv:
        silu_rows()
        return
    print("bit mismatches kernel vs reference (token, group128, tensor):", check_bit_exact())
    ceiling = copy_bandwidth_gbs()
    rows = []
    for m, k in SHAPES:
        io_bytes = lambda groups: m * k * 2 + m * k + m * groups * 4  # bf16 in, fp8 out, fp32 scales
        args = rotating(lambda: (torch.randn(m, k, device="cuda", dtype=torch.bfloat16),), m * k * 2)
        scale = torch.tensor(0.05, device="cuda")
        cases = {
            "token": (lambda x: quantize_fp8_rows(x, k), io_bytes(1)),
            "group128": (lambda x: quantize_fp8_rows(x, 128), io_bytes(k // 128)),
            "static": (lambda x: quantize_fp8_static(x, scale), io_bytes(0)),
            # two passes over x (amax, then codes); GB/s counts its bytes once, as for the others
            "tensor (dynamic)": (lambda x: quantize_fp8_tensor(x), io_bytes(0)),
            "torch_ref_group128": (
                lambda x: fxquant.quantize(x, "fp8_e4m3", ("group", 128), impl="reference"), io_bytes(k // 128)),
        }
        for name, (fn, nbytes) in cases.items():
            ms = graph_time_ms(fn, args)
            rows.append({"M": m, "K": k, "kernel": name, "us": f"{ms * 1e3:.1f}",
                         "GB/s": f"{nbytes / ms / 1e6:.0f}", "% copy": f"{100 * nbytes / ms / 1e6 / ceiling:.0f}"})
    print(f"copy ceiling (read+write): {ceiling:.0f} GB/s")
    print(table(rows))


if __name__ == "__main__":
    main()
