"""Tile configurations for the fp8 GEMM, by M bucket, so no autotuning runs at a user's first call.

Buckets follow how LLM serving sees M: decode (M <= 16) streams the weight and wants many CTAs over N;
medium M balances tiles against the number of CTAs; large M wants big tiles for reuse. Block-scaled
GEMMs fix BLOCK_K = 128 (one scale per K step) and BLOCK_N <= 128 (one weight-scale block per tile).
Interpreter runs (CPU tests) use the same tables.
"""

from __future__ import annotations

# (max M, config): the first bucket whose max M >= M wins.
FP8_GEMM_BUCKETS = [
    (16, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5)),
    (128, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)),
    (None, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4)),
]


def fp8_gemm_config(M: int, N: int, K: int, block_scales: bool) -> dict:
    for max_m, cfg in FP8_GEMM_BUCKETS:
        if max_m is None or M <= max_m:
            return dict(cfg)
    raise AssertionError("unreachable: the last bucket has no bound")
