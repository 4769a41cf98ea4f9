"""Where an fp8_row decode layer's time goes with its kernels launched as the step launches them (dependent launch
on, one CUDA graph), by taking parts out of the chain of `bench.l2_ahead` (32 Llama-3-8B layers, decode attention
over 1024 cached tokens). A profile cannot say it: it launches each kernel alone, without the overlap of one
kernel's launch with the previous one's tail.

- the layer: per-token quantize, q/k/v, decode attention with its output quantized, o_proj, quantize, gate/up,
  SiLU x up with its quantizer, down_proj, the residual add (9 kernels);
- attention as a row quantizer: attention replaced by the per-token quantizer of q (`bench.split_sums`' stand-in);
- the four GEMMs alone: q/k/v, o_proj, gate/up and down_proj over fixed codes (4 kernels), each waiting for the one
  before as the step's do.

The table gives microseconds a layer and the layer's weight bytes (218 MB) over that time as a share of the copy
bandwidth; the differences are what attention and the row kernels add to the layer.

Run: python -m bench.chain_parts [--layers 32] [--batches 1 16] [--context 1024]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth_gbs, graph_time_ms, header, table
from bench.l2_ahead import HIDDEN, INTER, SHAPES, caches, chain, layer_weights
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows

gemm = lambda a, a_scale, w, w_scale: fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16)


def without_attention(h: torch.Tensor, layers) -> torch.Tensor:
    """The layer with attention replaced by the per-token quantizer of q."""
    for (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down) in layers:
        qkv = gemm(*quantize_fp8_rows(h, HIDDEN), w_qkv, s_qkv)
        o = gemm(*quantize_fp8_rows(qkv[:, :HIDDEN].contiguous(), HIDDEN), w_o, s_o)
        gate, up = gemm(*quantize_fp8_rows(o, HIDDEN), w_gu, s_gu).chunk(2, dim=-1)
        h = h + gemm(*silu_mul_quantize_fp8_rows(gate, up, INTER), w_down, s_down)
    return h


def gemms_alone(codes: dict, layers) -> torch.Tensor:
    """The four GEMMs of each layer over fixed codes of their inputs."""
    out = None
    for (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down) in layers:
        gemm(*codes[HIDDEN], w_qkv, s_qkv)
        gemm(*codes[HIDDEN], w_o, s_o)
        gemm(*codes[HIDDEN], w_gu, s_gu)
        out = gemm(*codes[INTER], w_down, s_down)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    args = parser.parse_args()
    print(header())
    bandwidth = copy_bandwidth_gbs()
    layers = layer_weights(args.layers)
    layer_bytes = sum(n * k for n, k in SHAPES)
    rows = []
    for batch in args.batches:
        kv = caches(args.layers, batch, args.context)
        h = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        codes = {k: quantize_fp8_rows(torch.randn(batch, k, device="cuda", dtype=torch.bfloat16), k)
                 for k in (HIDDEN, INTER)}
        parts = {"the layer": lambda: chain(h, layers, kv, None),
                 "attention as a row quantizer": lambda: without_attention(h, layers),
                 "the four GEMMs alone": lambda: gemms_alone(codes, layers)}
        us = {}
        for name, run in parts.items():
            out = run()
            # without attention's normalization the residual grows past bf16's range within 32 layers (as in
            # bench.split_sums), to inf and NaN: only the layer's output is checked; the others time the same kernels
            assert name != "the layer" or (torch.isfinite(out).all() and out.abs().max() > 0), name
            us[name] = 1e3 * graph_time_ms(run, [()]) / args.layers
            print(batch, name, f"{us[name]:.1f} us", flush=True)
        row = {"B": batch}
        row.update({name: f"{t:.1f} us, {100 * layer_bytes / (t * 1e-6) / (bandwidth * 1e9):.0f}%"
                    for name, t in us.items()})
        row["attention adds"] = f"{us['the layer'] - us['attention as a row quantizer']:.1f} us"
        row["row kernels add"] = f"{us['attention as a row quantizer'] - us['the four GEMMs alone']:.1f} us"
        rows.append(row)
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {args.layers} layers over {args.context} cached tokens; "
          "us a layer, the weights' bytes over that time")
    print(table(rows))


if __name__ == "__main__":
    main()
