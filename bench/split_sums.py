"""Split-K summed by each tile's last slice against the reduce kernel, in a chain of the fp8_row decode GEMMs of
Llama-3-8B layers replayed from a CUDA graph: the step's GEMM kernels without attention, the host, or Inductor.

Each layer quantizes its input per token, runs the merged q/k/v product (6144 x 4096), quantizes its first 4096
columns (attention's stand-in), runs o_proj (4096 x 4096), quantizes, runs the merged gate/up product (28672 x 4096),
quantizes silu(gate) * up in one kernel, runs down_proj (4096 x 14336) and adds it to the residual: 8 kernels a
layer, and 4 more where the reduce kernel sums the split products. Weights are e4m3 codes of N(0, 1) with per-channel
scales 1 / sqrt(K), so each product keeps its input's size (SiLU x up squares it: the residual grows through the
layers). The two ways give the same bits (checked first); the table gives microseconds a layer with and without
programmatic dependent launch, and the weights' bytes over that time as a share of the copy bandwidth measured in the
same process. --swap adds the chain with the GEMMs' operands swapped (SWAP_AB: wgmma on the weight's codes), summed
by the last slice with PDL on. Its sums run in another order, so each GEMM of a layer is checked alone against the
fp64 product, and the chain's distance from the default is printed.

Run: python -m bench.split_sums [--layers 8] [--batches 1 16] [--swap]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth_gbs, graph_time_ms, header, table
from fxquant.kernels.dependent_launch import dependent_launches
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows
from fxquant.kernels.splitk import reduce_in_gemm

HIDDEN, INTER, QKV = 4096, 14336, 6144
SWAPPED = {"SWAP_AB": True}  # over each GEMM's decode tiles (bench.fp8_gemm --sweep --decode tries more)
SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))  # (N, K) of each GEMM of a layer


def weights(layers: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [[(torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn),
              torch.full((n, 1), k ** -0.5, device="cuda")) for n, k in SHAPES] for _ in range(layers)]


def chain(h: torch.Tensor, layers, config: dict | None = None) -> torch.Tensor:
    gemm = lambda a, a_scale, w, w_scale: fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16, config)
    for (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down) in layers:
        qkv = gemm(*quantize_fp8_rows(h, HIDDEN), w_qkv, s_qkv)
        o = gemm(*quantize_fp8_rows(qkv[:, :HIDDEN].contiguous(), HIDDEN), w_o, s_o)
        gate, up = gemm(*quantize_fp8_rows(o, HIDDEN), w_gu, s_gu).chunk(2, dim=-1)
        h = h + gemm(*silu_mul_quantize_fp8_rows(gate, up, INTER), w_down, s_down)
    return h


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--swap", action="store_true", help="also time the GEMMs with their operands swapped")
    args = parser.parse_args()
    print(header())
    bandwidth = copy_bandwidth_gbs()
    layers = weights(args.layers)
    layer_bytes = sum(n * k for n, k in SHAPES)  # one byte a code; the scales are 0.1% of it
    share = lambda us: f"{us:.1f} us, {100 * layer_bytes / (us * 1e-6) / (bandwidth * 1e9):.0f}%"
    rows = []
    for batch in args.batches:
        h = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        with reduce_in_gemm(False), dependent_launches(False):
            want = chain(h, layers)
        assert torch.isfinite(want).all() and want.abs().max() > 0
        row = {"B": batch}
        for in_gemm in (True, False):
            for pdl in (True, False):
                with reduce_in_gemm(in_gemm), dependent_launches(pdl):
                    assert torch.equal(chain(h, layers), want), f"B{batch}: the sums differ"  # the bits, eagerly
                    us = 1e3 * graph_time_ms(lambda: chain(h, layers), [()]) / args.layers
                name = f"{'last slice' if in_gemm else 'reduce kernel'}, PDL {'on' if pdl else 'off'}"
                row[name] = share(us)
        if args.swap:
            with reduce_in_gemm(True), dependent_launches(True):
                # Each GEMM of a layer alone against the fp64 product of its codes: the two loops sum in another
                # order, so they are bounded, not compared bit for bit. The chain itself is not the check: 8 layers
                # of random weights grow the activations 10^6-fold, and any moved code compounds.
                for n, k in SHAPES:
                    a, a_scale = quantize_fp8_rows(h if k == HIDDEN else torch.randn(batch, k, device="cuda",
                                                   dtype=torch.bfloat16), k)
                    w, w_scale = layers[0][SHAPES.index((n, k))]
                    exact = (a.double() @ w.double().t()) * a_scale.double() * w_scale.double().t()
                    for config in (None, SWAPPED):
                        got = fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16, config)
                        err = float((got.double() - exact).norm() / exact.norm())
                        name = "swapped" if config else "default"
                        print(f"B{batch} {n}x{k} {name}: relative error {err:.2e}", flush=True)
                        assert err < 1e-2, f"B{batch} {n}x{k} {name}: relative error {err:.2e}"
                got = chain(h, layers, SWAPPED).float()
                row["swapped vs default, chain"] = f"{float((got - want.float()).norm() / want.float().norm()):.1e}"
                us = 1e3 * graph_time_ms(lambda: chain(h, layers, SWAPPED), [()]) / args.layers
            row["swapped, last slice, PDL on"] = share(us)
        rows.append(row)
        print(row, flush=True)
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {args.layers} layers; us a layer, weights' bytes over that time")
    print(table(rows))


if __name__ == "__main__":
    main()
