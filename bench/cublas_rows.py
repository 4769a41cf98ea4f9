"""Which row counts cuBLAS's rowwise and 1x128 block-scaled fp8 GEMMs (`torch._scaled_mm`, as
`fxquant.kernels.cublas_fp8.cublas_scaled_mm` calls them) take on this GPU, over the Llama and Mixtral weight shapes:
each (rows, N x K) runs once from fresh contiguous operands and prints ok or cuBLAS's error.

    python -m bench.cublas_rows [--rows 129 200 984 992 1000 1024 4096]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import header, table
from fxquant.kernels.cublas_fp8 import cublas_scaled_mm

SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (28672, 4096)]


def outcome(rows: int, n: int, k: int, block_scales: bool) -> str:
    a = torch.randn(rows, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    a_scale = torch.rand(rows, k // 128 if block_scales else 1, device="cuda") + 0.5
    w_scale = torch.rand(*((n // 128, k // 128) if block_scales else (n, 1)), device="cuda") + 0.5
    try:
        cublas_scaled_mm(a, a_scale, w, w_scale, block_scales)
        torch.cuda.synchronize()
        return "ok"
    except RuntimeError as error:
        return str(error).split("when calling")[0].strip()[:40]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[129, 200, 984, 992, 1000, 1024, 4096])
    args = parser.parse_args()
    print(header())
    rows = [{"rows": m, "N x K": f"{n}x{k}", "rowwise": outcome(m, n, k, False), "1x128 blocks": outcome(m, n, k, True)}
            for m in args.rows for n, k in SHAPES]
    print(table(rows))


if __name__ == "__main__":
    main()
