"""Where an fp8_row decode layer's time goes with its kernels launched as the step launches them (dependent launch
on, one CUDA graph), by taking parts out of the chain of `bench.layer_chain` (32 Llama-3-8B layers, decode attention
over 1024 cached tokens). A profile cannot say it: it launches each kernel alone, without the overlap of one
kernel's launch with the previous one's tail.

- the layer: per-token quantize, q/k/v, decode attention with its output quantized, o_proj, quantize, gate/up,
  SiLU x up with its quantizer, down_proj, the residual add (9 kernels);
- attention as a row quantizer: `bench.split_sums`' chain, attention replaced by the per-token quantizer of q (and,
  past one row, a copy of q's columns before it);
- the four GEMMs alone: q/k/v, o_proj, gate/up and down_proj over fixed codes (4 kernels), each waiting for the one
  before as the step's do.

The differences are what attention and the five row kernels add to the layer. Without attention's normalization the
residual grows past bf16's range within 32 layers (as in `bench.split_sums`), so only the layer's output is checked.

Run: python -m bench.chain_parts [--layers 32] [--batches 1 16] [--context 1024]
"""

from __future__ import annotations

import torch

from bench import layer_chain, split_sums
from bench.common import table
from bench.layer_chain import HIDDEN, arguments, chain, time_variants
from bench.split_sums import INTER
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows

LAYER, ROW_KERNELS, GEMMS = "the layer", "attention as a row quantizer", "the four GEMMs alone"


def fixed_codes(state: dict) -> dict:
    """Per-token codes of random inputs of each K for the batch, made at the first (untimed) run and kept in its
    state, so that the timed graph holds the GEMMs alone."""
    if "codes" not in state:
        gen = torch.Generator(device=layer_chain.DEVICE).manual_seed(3)
        state["codes"] = {k: quantize_fp8_rows(torch.randn(state["batch"], k, device=layer_chain.DEVICE,
                                                           dtype=torch.bfloat16, generator=gen), k)
                          for k in (HIDDEN, INTER)}
    return state["codes"]


def gemms_alone(codes: dict, layers) -> torch.Tensor:
    """The four GEMMs of each layer over fixed codes of their inputs."""
    out = None
    for (w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down) in layers:
        for w, w_scale, k in ((w_qkv, s_qkv, HIDDEN), (w_o, s_o, HIDDEN), (w_gu, s_gu, HIDDEN),
                              (w_down, s_down, INTER)):
            out = fp8_scaled_mm(*codes[k], w, w_scale, None, torch.bfloat16)
    return out


def only_the_layer_finite(name: str, out: torch.Tensor, first, state: dict) -> None:
    assert name != LAYER or (torch.isfinite(out).all() and out.abs().max() > 0), f"B{state['batch']} {name}"


def main() -> None:
    args = arguments(__doc__).parse_args()
    results = time_variants(args, {LAYER: lambda s: chain(s["h"], s["layers"], s["kv"]),
                                   ROW_KERNELS: lambda s: split_sums.chain(s["h"], s["layers"]),
                                   GEMMS: lambda s: gemms_alone(fixed_codes(s), s["layers"])},
                            only_the_layer_finite)
    print(table([{"B": batch, "attention adds": f"{us[LAYER] - us[ROW_KERNELS]:.1f} us",
                  "the row kernels add": f"{us[ROW_KERNELS] - us[GEMMS]:.1f} us"}
                 for batch, us in zip(args.batches, results, strict=True)]))


if __name__ == "__main__":
    main()
