"""Tile configurations for the fp8 GEMM, by M bucket, so no autotuning runs at a user's first call.

Buckets follow how LLM serving sees M: decode (M <= 16) streams the weight and wants many CTAs over N;
medium M balances tile reuse against CTA count; large M wants big tiles. Block-scaled GEMMs fix
BLOCK_K = 128 (one scale per K step) and BLOCK_N <= 128 (one weight-scale block per tile).
The picks are the winners of `bench/kernels.py --sweep` on an H200 (BENCHMARKS.md) for the Llama shapes
(N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}; at medium M narrow N (<= 8192) prefers narrower tiles,
which put more CTAs on the 132 SMs. Decode tiles come from `--sweep --decode`, which also sweeps the split-K
target `programs`.
"""

from __future__ import annotations

from fxquant.kernels.splitk import TARGET_PROGRAMS


def fp8_gemm_config(M: int, N: int, K: int, block_scales: bool) -> dict:
    wide = N > 8192
    if M <= 16:
        long_k_blocks = block_scales and K > 8192  # 528 programs won for block scales at K = 14336
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4,
                    num_stages=4 if block_scales or N * K <= 2**24 else 6,
                    programs=2 * TARGET_PROGRAMS if long_k_blocks else TARGET_PROGRAMS)
    if M <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128 if wide else 64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if block_scales:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


# M values that land in each bucket: tests run every one of them.
BUCKET_PROBES = (16, 128, 200)
