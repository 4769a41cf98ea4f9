"""The fp8 decode GEMMs' tiles, and decode attention's split count, in the chain of fp8_row decode layers of
`bench.layer_chain`. A single GEMM timed alone ends when its slowest program does; in the chain the next kernel
launches after each program's K loop, so the tail that split-K adds may weigh differently there.

- The split-K tiles the sweep of single GEMMs chose (`gemm_configs`) against narrow tiles over the whole K (no
  partials, no last-slice sum) and fewer slices, on q/k/v (6144 x 4096), o_proj (4096 x 4096) and down_proj
  (4096 x 14336); gate/up (28672 x 4096) is not split either way, and four variants change its tiles alone (wider,
  narrower, deeper, or two slices).
- 2 or 8 warps a program on every GEMM, and K steps of 256 or 512 columns in place of 128 (the sweep of single GEMMs
  tried 4 warps and 128 only): half or a quarter of the steps, and their loop overhead, for the same bytes.
- More bytes in flight on every GEMM, for the H200's bandwidth (the picks above were timed on the H100): 6 or 8
  stages, or K split toward 396 or 528 programs in place of 264.
- The weight's tiles through a tensor descriptor (`WEIGHT_TMA`) on every GEMM, at the planned tiles, 6 or 8 stages,
  or with 128-wide gate/up tiles.
- Decode attention's keys split 1, 2, 4 or 16 ways in place of the count it plans (8 at B1, 3 at B16 over 1024
  keys, chosen by timing the kernel alone; 16 at B1: one 64-key block a program, 128 programs), and its other
  plans: 128- or 32-key blocks, 8 warps, 3 stages.

Each variant's GEMMs are checked alone against the fp64 product of their codes (split-K sums in another order, so
the chains are not compared bit for bit).

Run: python -m bench.chain_tiles [--layers 32] [--batches 1 16] [--variants NAME ...]
"""

from __future__ import annotations

import contextlib

import torch

from bench.layer_chain import SHAPES, arguments, chain, time_variants
from fxquant.kernels import decode_attention
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.splitk import TARGET_PROGRAMS

SPLIT = ((6144, 4096), (4096, 4096), (4096, 14336))  # the GEMMs of a layer that split K by default
narrow = lambda n, stages: dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=stages)
VARIANTS = {
    "split-K (default)": {},
    "16 wide, whole K, 8 stages": {shape: {**narrow(16, 8), "SPLIT_K": 1} for shape in SPLIT},
    "16 wide, whole K, 12 stages": {shape: {**narrow(16, 12), "SPLIT_K": 1} for shape in SPLIT},
    "32 wide, 2 slices, 6 stages": {shape: {**narrow(32, 6), "SPLIT_K": 2} for shape in SPLIT},
    "32 wide, 2 slices, 4 stages": {shape: {**narrow(32, 4), "SPLIT_K": 2} for shape in SPLIT},
    "32 wide, 2 slices, 8 stages": {shape: {**narrow(32, 8), "SPLIT_K": 2} for shape in SPLIT},
    "32 wide, split as the default, 6 stages": {shape: {**narrow(32, 6)} for shape in SPLIT},
    "64 wide, 2 slices, 6 stages": {shape: {**narrow(64, 6), "SPLIT_K": 2} for shape in SPLIT},
    # the merged gate/up (28672 x 4096, 448 tiles of 64 rows, unsplit), the rest as the default plans it
    "gate/up 128 wide, 4 stages": {(2 * 14336, 4096): narrow(128, 4)},
    "gate/up 32 wide, 6 stages": {(2 * 14336, 4096): narrow(32, 6)},
    "gate/up 64 wide, 6 stages": {(2 * 14336, 4096): narrow(64, 6)},
    "gate/up 64 wide, 2 slices": {(2 * 14336, 4096): {**narrow(64, 4), "SPLIT_K": 2}},
    # warps a program on every GEMM (the sweep of single GEMMs ran 4)
    "2 warps": {shape: {"num_warps": 2} for shape in SHAPES},
    "8 warps": {shape: {"num_warps": 8} for shape in SHAPES},
    # longer K steps on every GEMM, the default's tiles and split target otherwise (fewer steps for the same bytes)
    "K steps of 256, 3 stages": {shape: {"BLOCK_K": 256, "num_stages": 3} for shape in SHAPES},
    "K steps of 256, 4 stages": {shape: {"BLOCK_K": 256, "num_stages": 4} for shape in SHAPES},
    "K steps of 512, 2 stages": {shape: {"BLOCK_K": 512, "num_stages": 2} for shape in SHAPES},
    # more bytes in flight on every GEMM, for a GPU with more bandwidth than the H100 the picks were timed on:
    # deeper pipelines, or more slices (the split target at three or four programs an SM)
    "6 stages": {shape: {"num_stages": 6} for shape in SHAPES},
    "8 stages": {shape: {"num_stages": 8} for shape in SHAPES},
    "split toward 396 programs": {shape: {"programs": 3 * TARGET_PROGRAMS // 2} for shape in SHAPES},
    "split toward 528 programs": {shape: {"programs": 2 * TARGET_PROGRAMS} for shape in SHAPES},
    # the weight's tiles through a tensor descriptor (the copy engine fills shared memory; no load instructions or
    # registers a stage), as planned, deeper, and with the gate/up tiles wider
    "weight through TMA": {shape: {"WEIGHT_TMA": True} for shape in SHAPES},
    "weight through TMA, 6 stages": {shape: {"WEIGHT_TMA": True, "num_stages": 6} for shape in SHAPES},
    "weight through TMA, 8 stages": {shape: {"WEIGHT_TMA": True, "num_stages": 8} for shape in SHAPES},
    "weight through TMA, gate/up 128 wide": {**{shape: {"WEIGHT_TMA": True} for shape in SHAPES},
                                             (2 * 14336, 4096): {**narrow(128, 4), "WEIGHT_TMA": True}},
}


# decode attention over the bf16 cache: (split count, plan) in place of its own (8 splits at B1 and 3 at B16 over 1024
# keys, in the plan (2, 2, 4, 64): programs an SM wanted, key blocks a split, warps, keys a block[, stages])
ATTENTION = {"attention in 1 split": (1, None), "attention in 2 splits": (2, None),
             "attention in 4 splits": (4, None), "attention in 16 splits": (16, None),
             "attention in 128-key blocks, 3 stages": (None, (2, 1, 4, 128, 3)),
             "attention in 32-key blocks": (None, (2, 4, 4, 32)),
             "attention at 8 warps": (None, (2, 2, 8, 64)),
             "attention at 3 stages": (None, (2, 2, 4, 64, 3))}


@contextlib.contextmanager
def attention_launch(splits: int | None, plan: tuple | None):
    """Inside the block, decode attention launches in `plan` (split as `launch_plan` splits a given plan) and
    `splits` ways where given; None: as it plans."""
    planned = decode_attention.launch_plan

    def launch(batch_heads, keys, codes, device, given=None):
        chosen, count = planned(batch_heads, keys, codes, device, plan or given)
        return chosen, splits or count

    decode_attention.launch_plan = launch
    try:
        yield
    finally:
        decode_attention.launch_plan = planned


def check(tiles: dict, batch: int) -> None:
    """Each GEMM of a layer under `tiles` against the fp64 product of its codes."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    for n, k in SHAPES:
        a, a_scale = quantize_fp8_rows(torch.randn(batch, k, device="cuda", dtype=torch.bfloat16, generator=gen), k)
        w = torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn)
        w_scale = torch.full((n, 1), k ** -0.5, device="cuda")
        exact = (a.double() @ w.double().t()) * a_scale.double() * w_scale.double().t()
        got = fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16, tiles.get((n, k)))
        err = float((got.double() - exact).norm() / exact.norm())
        assert err < 1e-2, f"B{batch} {n}x{k} {tiles.get((n, k))}: relative error {err:.2e}"


def main() -> None:
    args = arguments(__doc__).parse_args()
    plans = {name: (tiles, None, None) for name, tiles in VARIANTS.items()}
    plans.update({name: ({}, *launch) for name, launch in ATTENTION.items()})

    def run(state: dict, tiles: dict, splits: int | None, plan: tuple | None) -> torch.Tensor:
        with attention_launch(splits, plan):
            return chain(state["h"], state["layers"], state["kv"], tiles=tiles)

    def checked(name: str, out: torch.Tensor, first, state: dict) -> None:
        check(plans[name][0], state["batch"])
        assert torch.isfinite(out).all() and out.abs().max() > 0, f"B{state['batch']} {name}"

    time_variants(args, {name: lambda state, p=plan: run(state, *p) for name, plan in plans.items()}, checked)


if __name__ == "__main__":
    main()
