"""The gated MLP of an fp8_row decode layer in two GEMMs (`fxquant.kernels.gated_mlp_fp8`: silu(gate) * up in the
gate/up GEMM's epilogue, the per-token quantizer in the down GEMM's K loop) against its three kernels (gate/up GEMM,
silu_mul_quant, down GEMM), in the chain of `bench.layer_chain` (32 Llama-3-8B layers in one CUDA graph, each kernel
launched dependent as the step launches it). The two give the same bits, so each variant's chain is checked equal
to the first's before it is timed.

- "three kernels (default)": the layer as the backend runs it;
- "two GEMMs": the gate/up GEMM's tiles as planned (64 rows: 32 gate and 32 up, 448 amax partials a token);
- "two GEMMs, gate/up 128 wide": 64 gate and 64 up rows a tile (224 partials a token);
- "two GEMMs, down 256 wide" and "two GEMMs, down 128 wide, 2 warps": the down GEMM's K loop also quantizes its
  step (260 SASS instructions a K step a thread against the fp8 GEMM's 154 at the planned 64-wide tiles, `python -m
  bench.sass gated`), so wider tiles a warp spread that cost over more weight: per column and K step, 274 and 304
  thread instructions against 520 at the planned tiles (the fp8 GEMM: 308).

Run: python -m bench.gated_mlp [--layers 32] [--batches 1 16] [--variants NAME ...]
"""

from __future__ import annotations

from bench.layer_chain import arguments, chain, same_bits, time_variants
from fxquant.kernels.gated_mlp_fp8 import gated_mlp_fp8

WIDE = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
DOWN_256 = dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
DOWN_128_2_WARPS = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=4)


def two_gemms(config_gu: dict | None, config_down: dict | None = None):
    return lambda a, a_scale, w_gu, s_gu, w_down, s_down: gated_mlp_fp8(a, a_scale, w_gu, s_gu, w_down, s_down,
                                                                         config_gu, config_down)


VARIANTS = {"three kernels (default)": None, "two GEMMs": two_gemms(None),
            "two GEMMs, gate/up 128 wide": two_gemms(WIDE), "two GEMMs, down 256 wide": two_gemms(None, DOWN_256),
            "two GEMMs, down 128 wide, 2 warps": two_gemms(None, DOWN_128_2_WARPS)}


def main() -> None:
    args = arguments(__doc__).parse_args()
    time_variants(args, {name: lambda state, mlp=mlp: chain(state["h"], state["layers"], state["kv"], gated_mlp=mlp)
                         for name, mlp in VARIANTS.items()}, same_bits)


if __name__ == "__main__":
    main()
