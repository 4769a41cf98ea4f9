"""Tile configurations for the fp8 GEMM, by M bucket, so no autotuning runs at a user's first call.

Buckets follow how LLM serving sees M: decode (M <= 16) streams the weight and wants many CTAs over N;
medium M balances tile reuse against CTA count; large M wants big tiles. Block-scaled GEMMs fix
BLOCK_K = 128 (one scale per K step) and BLOCK_N <= 128 (one weight-scale block per tile).
The picks are the winners of `bench/fp8_gemm.py --sweep` on an H200 (docs/decisions/0004-fp8-gemm-tiles.md) for the
Llama shapes (N, K) in {(4096, 4096), (14336, 4096), (4096, 14336)}, and at decode also the merged q/k/v and gate/up
(6144 and 28672 x 4096, `--merged`); at medium M narrow N (<= 8192) prefers narrower tiles, which put more CTAs on the
132 SMs. Decode tiles come from `--sweep --decode`, which also sweeps the split-K target `programs`, and past 8 rows
from the chain of a decode layer's kernels (`bench/chain_tiles.py`), where a single GEMM's winner can lose;
medium-M tiles from `--sweep --medium` (M = 64, 128, the Llama and merged shapes), where split-K also pays on long K
and up to M = 64. Past M = 128, operands that tensor descriptors can read run the persistent TMA kernel
(`gemm_fp8_tma.py`) with the winners of `--sweep --large`; the pointer kernel's tiles remain for the rest.
"""

from __future__ import annotations

from fxquant.kernels.splitk import TARGET_PROGRAMS


def fp8_gemm_config(M: int, N: int, K: int, block_scales: bool, tma: bool = False) -> dict:
    """Tiles for an [M, K] x [N, K] product; `tma`: the operands can go through the persistent TMA kernel."""
    wide = N > 8192
    if M <= 16:
        # Sweep winners: 528 programs for block scales at K = 14336 and for 16M-32M-element weights (a merged
        # 6144x4096 q/k/v: its 96 tiles split only 2 ways toward 264); 6 stages only for row scales on 32M-64M
        # elements (14336x4096, 4096x14336).
        many_programs = (block_scales and K > 8192) or 2**24 < N * K <= 2**25
        deep = not block_scales and 2**25 < N * K <= 2**26
        # The operands stay as given (SWAP_AB off): swapped, the chain of a Llama-3-8B layer's GEMMs was 1.7% (B1)
        # and 3.8% (B16) faster, but wgmma's fp8 accumulation, promoted every 128 K, put 8e-5 of relative error in
        # a K = 256 product, past the 1e-5 the fp16 MMA meets (docs/decisions/0023-decode-gemm-operands-as-given.md).
        decode = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=6 if deep else 4,
                      programs=2 * TARGET_PROGRAMS if many_programs else TARGET_PROGRAMS)
        if M > 8 and not block_scales and N * K <= 2**26:
            # Past 8 rows, the weights that split (q/k/v, o, down) take 32-wide tiles at 6 stages: two slices each.
            # In the 32-layer chain of a Llama-3-8B layer's kernels with decode attention, B16 ran 125.4-126.4 us a
            # layer against 128.4-129.0 (H100, three runs); B1-B8 tied, so they keep the sweep's tiles
            # (docs/decisions/0035-decode-tiles-past-eight-rows.md).
            decode.update(BLOCK_N=32, num_stages=6)
        return decode
    medium = dict(BLOCK_M=64, BLOCK_N=128 if wide else 64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    # `--sweep --medium` winners: split-K also pays here where the tiles are few. A long K (down_proj,
    # 4096x14336) splits 4 ways at M = 64 and 128 (41 -> 26 us at M = 64); up to M = 64, weights of at most
    # 16384 rows take 64-wide tiles, which split the 4096x4096 o_proj 4 ways (13.0 -> 10.9 us).
    if M <= 128 and K > 8192:
        return {**medium, "BLOCK_N": 128, "programs": TARGET_PROGRAMS // 2 if M <= 64 else TARGET_PROGRAMS}
    if M <= 64 and N <= 16384:
        return {**medium, "BLOCK_N": 64, "programs": TARGET_PROGRAMS}
    if M <= 128:
        return medium
    if tma:
        # 2 warpgroups; block scales keep one weight scale per tile (BLOCK_N 128). Stages fit an fp32 output
        # tile's 64 KB epilogue scratch beside the pipeline in 227 KB of shared memory: 256x128 at 4 stages did not.
        return dict(TMA=True, BLOCK_M=128 if block_scales else 256, BLOCK_N=128, BLOCK_K=128, GROUP_M=8,
                    num_warps=8, num_stages=5 if block_scales else 3)
    if block_scales:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


# M values that land in each bucket: tests run every one of them.
BUCKET_PROBES = (8, 16, 128, 200)
