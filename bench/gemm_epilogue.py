"""The decode fp8 GEMM with the row work after it in its epilogue (`gemm_fp8_epilogue.py`) against the GEMM and the
kernel after it, in a chain of Llama-3-8B decode layers replayed from a CUDA graph.

Each layer: the merged q/k/v product (6144 x 4096) of the normalized input, its first 4096 columns quantized per
token (attention's stand-in), o_proj (4096 x 4096) then the residual add and post-attention norm, the merged gate/up
product (28672 x 4096) then silu(gate) * up quantized, down_proj (4096 x 14336) then the add and the next layer's
input norm: 8 kernels a layer, 6 with the norms in their GEMMs ("norm"), 7 with SiLU in its GEMM ("silu"), 5 with
both. Weights are `bench.split_sums`'s (e4m3 codes of N(0, 1), scales 1 / sqrt(K)); each layer reads its own, past
the L2.

Checked first, on the first layer's operands: each fused kernel's residual stream (norm) and codes (SiLU) equal the
two kernels' bit for bit, and the norm's codes are within one e4m3 step (its sums run in another thread layout);
past an epilogue's row cap (gemm_fp8_epilogue.MAX_ROWS) its column runs the two kernels, and says so. The
table gives microseconds a layer, PDL on and off, and the weights' bytes over that time as a share of the copy
bandwidth.

Run: python -m bench.gemm_epilogue [--layers 8] [--batches 1 4 16]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth_gbs, graph_time_ms, header, table
from bench.split_sums import HIDDEN, INTER, SHAPES, weights
from fxquant.kernels.dependent_launch import dependent_launches
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_fp8_epilogue import (
    fp8_scaled_mm_add_norm_quant,
    fp8_scaled_mm_silu_mul_quantize,
    refusal,
    silu_refusal,
)
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
from fxquant.kernels.quant_fp8 import quantize_fp8_rows, silu_mul_quantize_fp8_rows

EPS = 1e-5
FUSIONS = {"two kernels each": (), "norm": ("norm",), "silu": ("silu",), "both": ("norm", "silu")}


def add_norm(a, a_scale, w, w_scale, h, norm_weight, fused: bool):
    """(codes, scales, h + a @ w.T) of the norm after a GEMM: one kernel, or the GEMM then the norm kernel."""
    if fused:
        return fp8_scaled_mm_add_norm_quant(a, a_scale, w, w_scale, None, h, norm_weight, None, EPS)
    product = fp8_scaled_mm(a, a_scale, w, w_scale, None, h.dtype)
    codes, scales, h, _ = norm_quant_fp8(h, norm_weight, None, EPS, 0, residual=product)
    return codes, scales, h


def silu_mul(a, a_scale, w, w_scale, fused: bool):
    """(codes, scales) of SiLU x up after the merged gate/up GEMM: one kernel, or the GEMM then the SiLU kernel."""
    if fused:
        return fp8_scaled_mm_silu_mul_quantize(a, a_scale, w, w_scale, None)
    gate, up = fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16).chunk(2, dim=-1)
    return silu_mul_quantize_fp8_rows(gate, up, gate.shape[-1])


def chain(h, layers, norms, fused: tuple[str, ...]):
    codes, scales, _, _ = norm_quant_fp8(h, norms[0][0], None, EPS, 0)  # the first layer's input norm
    for ((w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down)), (_, post, following) in zip(layers, norms,
                                                                                                   strict=True):
        qkv = fp8_scaled_mm(codes, scales, w_qkv, s_qkv, None, torch.bfloat16)
        codes, scales, h = add_norm(*quantize_fp8_rows(qkv[:, :HIDDEN].contiguous(), HIDDEN), w_o, s_o, h, post,
                                    "norm" in fused)
        codes, scales = silu_mul(codes, scales, w_gu, s_gu, "silu" in fused)
        codes, scales, h = add_norm(codes, scales, w_down, s_down, h, following, "norm" in fused)
    return h


def check(batch: int, layers, norms) -> None:
    """The first layer's o_proj, gate/up and down_proj, fused against the two kernels."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    h = torch.randn(batch, HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
    quantized = lambda k: quantize_fp8_rows(torch.randn(batch, k, device="cuda", generator=gen).to(torch.bfloat16), k)
    for (w, w_scale), k in ((layers[0][1], HIDDEN), (layers[0][3], INTER)):
        a, a_scale = quantized(k)
        if (why := refusal(a, a_scale, w, w_scale, h, 0)) is not None:
            print(f"B{batch} norm after K={k}: the two kernels run ({why})", flush=True)
            continue
        got, want = (add_norm(a, a_scale, w, w_scale, h, norms[0][1], fused) for fused in (True, False))
        assert torch.equal(got[2], want[2]), f"B{batch} K={k}: the residual stream differs"
        steps = (got[0].view(torch.uint8).int() - want[0].view(torch.uint8).int()).abs()
        moved = float((steps > 0).float().mean())
        print(f"B{batch} norm after K={k}: residual stream equal; codes moved {100 * moved:.3f}%, at most "
              f"{int(steps.max())} step(s); scales differ at most {float((got[1] / want[1] - 1).abs().max()):.1e}",
              flush=True)
        assert steps.max() <= 1
    (w, w_scale), (a, a_scale) = layers[0][2], quantized(HIDDEN)
    if (why := silu_refusal(a, a_scale, w, w_scale, torch.bfloat16)) is not None:
        print(f"B{batch} SiLU after gate/up: the two kernels run ({why})", flush=True)
        return
    got, want = (silu_mul(a, a_scale, w, w_scale, fused) for fused in (True, False))
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(got, want, strict=True))
    print(f"B{batch} SiLU after gate/up: codes and scales equal", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    print(header())
    bandwidth = copy_bandwidth_gbs()
    layers = weights(args.layers)
    gen = torch.Generator(device="cuda").manual_seed(1)
    norms = [tuple((1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).to(torch.bfloat16) for _ in range(3))
             for _ in range(args.layers)]  # (input, post-attention, next input) weights of each layer
    layer_bytes = sum(n * k for n, k in SHAPES)
    share = lambda us: f"{us:.1f} us, {100 * layer_bytes / (us * 1e-6) / (bandwidth * 1e9):.0f}%"
    rows = []
    for batch in args.batches:
        check(batch, layers, norms)
        h = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for pdl in (True, False):
            row = {"B": batch, "PDL": "on" if pdl else "off"}
            for name, fused in FUSIONS.items():
                with dependent_launches(pdl):
                    assert torch.isfinite(chain(h, layers, norms, fused)).all()
                    us = 1e3 * graph_time_ms(lambda fused=fused: chain(h, layers, norms, fused), [()]) / args.layers
                row[name] = share(us)
            rows.append(row)
            print(row, flush=True)
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {args.layers} layers; us a layer, weights' bytes over that time; "
          "columns: which epilogues the GEMMs run")
    print(table(rows))


if __name__ == "__main__":
    main()
