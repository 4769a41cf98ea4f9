"""The weight-only prefill route (dequantize, then cuBLAS) with its weight dequantized in chunks of rows small enough
for the L2 to hold, against bf16 cuBLAS in the same process.

Past DEQUANTIZE_ABOVE_M rows, `weight_only_mm` dequantizes the int4 weight to bf16 at most CHUNK_ELEMENTS at a time
and cuBLAS multiplies each chunk into its output columns. At the product's 2**27 elements a Llama weight is one chunk:
its bf16 copy is written to HBM and read back by the GEMM. A chunk of 2**23-2**24 elements (16-32 MB) is freed
before the next is dequantized, so the caching allocator may hand each chunk the same block (inside a CUDA graph's
capture too: a block freed there is reused by the capture's later requests), which the L2 may hold from the
dequantizer's writes to the GEMM's reads; each chunk's GEMM, though, has fewer output tiles to spread over the SMs.
Each route's product is checked against the one-chunk route's (relative difference) before it is timed; codes as the
backend holds them on the GPU (`code_tiles`).

Run: python -m bench.weight_only_chunks [--ms 1024 4096] [--chunks 27 25 24 23 22]   (chunk sizes as powers of two)
"""

from __future__ import annotations

import argparse
from unittest.mock import patch

import torch

from bench.common import graph_time_ms, header, rotating, table
from fxquant.kernels import gemm_weight_only
from fxquant.kernels.code_tiles import tile_codes
from fxquant.kernels.gemm_weight_only import weight_only_mm
from fxquant.numerics import reference as R

# Llama-3-8B's linears as the backend multiplies them: merged q/k/v and gate/up, o_proj and down_proj
SHAPES = {"q/k/v": (6144, 4096), "o": (4096, 4096), "gate/up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


def int4_weight(n: int, k: int, device: str) -> tuple:
    """(codes in tiles, scales, zero points) of a random weight quantized as int4_wo quantizes it."""
    q = R.quantize(torch.randn(n, k, device=device) * 0.02, "int4", ("group", GROUP))
    return tile_codes(q.data), q.scale, q.zero_point


def chunked_mm(x, weight, chunk_elements: int):
    """The route at one chunk size: every M dequantizes (no tile plan), CHUNK_ELEMENTS in place of the product's."""
    codes, scale, zero = weight
    with patch.object(gemm_weight_only, "CHUNK_ELEMENTS", chunk_elements), \
            patch.object(gemm_weight_only, "DEQUANTIZE_ABOVE_M", 0):
        gemm_weight_only._launch_plan.cache_clear()
        try:
            return weight_only_mm(x, codes, scale, "int4", GROUP, scale.shape[0], zero_point=zero)
        finally:
            gemm_weight_only._launch_plan.cache_clear()


def sweep(ms: list[int], chunk_logs: list[int], device: str = "cuda") -> list[dict]:
    rows = []
    for (name, (n, k)), m in ((s, m) for s in SHAPES.items() for m in ms):
        bf16_sets = rotating(lambda: (torch.randn(m, k, device=device, dtype=torch.bfloat16),
                                      torch.randn(n, k, device=device, dtype=torch.bfloat16)), (m + n) * k * 2)
        bf16_us = 1e3 * graph_time_ms(lambda x, w: x @ w.T, bf16_sets)
        row = {"M": m, "GEMM": f"{name} {n}x{k}", "bf16 us": f"{bf16_us:.0f}"}
        sets = rotating(lambda: (torch.randn(m, k, device=device, dtype=torch.bfloat16), int4_weight(n, k, device)),
                        m * k * 2 + n * k // 2)
        whole = chunked_mm(*sets[0], 2**27)
        for log in chunk_logs:
            got = chunked_mm(*sets[0], 2**log)
            diff = float((got.float() - whole.float()).norm() / whole.float().norm())
            assert diff < 1e-3, f"{name} at M = {m}, chunks of 2**{log}: {diff:.1e} from the one-chunk route"
            us = 1e3 * graph_time_ms(lambda x, w, log=log: chunked_mm(x, w, 2**log), sets)
            row[f"2**{log}"] = f"{us:.0f} us, {bf16_us / us:.2f}x, diff {diff:.0e}"
        rows.append(row)
        print(row, flush=True)
        del bf16_sets, sets
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[27, 25, 24, 23, 22],
                        help="chunk sizes in elements, as powers of two")
    args = parser.parse_args()
    print(header())
    print(table(sweep(args.ms, args.chunks)))


if __name__ == "__main__":
    main()
