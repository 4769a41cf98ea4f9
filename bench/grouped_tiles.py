"""The grouped fp8 GEMM of MoE prefill by its tiles and the order of its row tiles, on Mixtral-8x7B's experts
(8 x [28672, 4096] gate/up, 8 x [4096, 14336] down) with the rows `bench.moe`'s routing gives them, against bf16
`torch._grouped_mm`, torch's rowwise fp8 grouped GEMM (`torch._scaled_grouped_mm`, on Hopper) and the dense fp8 GEMM
expert by expert (row scales, the experts' row counts known on the host;
cuBLAS's rowwise fp8 GEMM, given slices of the experts' activations, refused 984 and 992 rows on the H100, where
`bench.cublas_rows` found fresh operands of those sizes taken).

Two scalings: row scales (fp8_row's experts) and the weight's per-channel 1x128 group scales beside per-token ones
(W4A8's codes made e4m3: the route from 128 rows an expert up to BY_EXPERT_ABOVE_M, and in a CUDA graph past it).
Each variant's output is checked against the dense kernel's (row scales) or the W4A8 product expert by expert
(groups) before it is timed; then, for W4A8, the two whole routes: the codes made e4m3 and the grouped kernel (what
a graph replays), and expert by expert on cuBLAS (what runs outside one, the offsets read on the host, timed as it
runs).

    python -m bench.grouped_tiles [--tokens 1024 4096] [--variants "the plan" "rows in plain order" ...]
"""

from __future__ import annotations

import argparse

import torch

from bench.common import graph_time_ms, header, table, time_ms
from bench.moe import EXPERTS, HIDDEN, INTERMEDIATE, TOP_K, graph_output, rel_error, routed
from fxquant.kernels import gemm_grouped as G
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_int4_fp8 import int4_as_e4m3
from fxquant.numerics import reference as R
from fxquant.ops import quantize_fp8

SHAPES = {"gate/up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
VARIANTS = {
    "the plan": {},
    # the Triton kernels' plan where the plan is torch's CUTLASS route (row scales past 128 rows an expert, sm_90)
    "the Triton plan": {"TMA": True},
    "rows in plain order": {"GROUP_M": 1},
    "the plan on pointers": {"TMA": False},
    "128x128, 4 warps, 4 stages": dict(TMA=False, BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=4),
    "128x128, 8 warps, 4 stages": dict(TMA=False, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
    "128x256, 8 warps, 3 stages": dict(TMA=False, BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
    "256x128, 8 warps, 3 stages": dict(TMA=False, BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3),
    "64x256, 4 warps, 4 stages": dict(TMA=False, BLOCK_M=64, BLOCK_N=256, num_warps=4, num_stages=4),
    # fewer stages: two or three programs an SM, so one's scaling of its fp32 partials overlaps another's MMAs (the
    # channel groups' K loop waits on each step's MMA before it scales it)
    "128x128, 8 warps, 3 stages": dict(TMA=False, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    "64x128, 4 warps, 4 stages": dict(TMA=False, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=4),
    "64x128, 4 warps, 3 stages": dict(TMA=False, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    "64x128, 4 warps, 2 stages": dict(TMA=False, BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    "128x64, 4 warps, 3 stages": dict(TMA=False, BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    # the weight's group scales stored N-contiguous ([E, K/128, N] seen as [E, N, K/128]): a K step's scales of a
    # tile are one contiguous read, where stored as quantized (K-contiguous) they are BLOCK_N reads of 4 bytes
    "channel scales N-contiguous": {"scales": "N-contiguous"},
    # through tensor descriptors (`gemm_grouped_tma`)
    "TMA 128x128, 8 warps, 4 stages": dict(TMA=True, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4),
    "TMA 256x128, 8 warps, 3 stages": dict(TMA=True, BLOCK_M=256, BLOCK_N=128, num_warps=8, num_stages=3),
    "TMA 128x256, 8 warps, 3 stages": dict(TMA=True, BLOCK_M=128, BLOCK_N=256, num_warps=8, num_stages=3),
}
# the kernels multiply the same fp8 operands and accumulate in fp32 in other orders, then round to bf16
AGREEMENT = 5e-3
DEVICE = "cuda"


def operands(tokens: int, n: int, k: int):
    """(per-token e4m3 activations and scales, offsets, row counts) of `tokens` routed top-2, rows sorted by expert."""
    _, ids, _ = routed(tokens, seed=0)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    x = torch.randn(tokens * TOP_K, k, device=DEVICE, dtype=torch.bfloat16)
    a, a_scale = quantize_fp8(x, 0)
    return x, a, a_scale, counts.cumsum(0).to(torch.int32), counts.tolist()


def dense_by_expert(a, a_scale, counts, b, b_scale) -> list:
    """The dense fp8 GEMM with row scales (past 128 rows its persistent TMA kernel), expert by expert: what the
    grouped kernel's tiles are against the dense ones' on the same rows."""
    outs, start = [], 0
    for e, rows in enumerate(counts):
        outs.append(fp8_scaled_mm(a[start:start + rows], a_scale[start:start + rows], b[e], b_scale[e]))
        start += rows
    return outs


def peer_available() -> bool:
    """torch's rowwise fp8 grouped GEMM (`torch._scaled_grouped_mm`, CUTLASS) runs on Hopper only."""
    return DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0) and hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(a, b_t, a_scale, b_scale, offs):
    """torch's rowwise fp8 grouped GEMM: a [M, K] row-major, b_t [E, K, N] column-major (the experts' [E, N, K] seen
    transposed), a_scale [M], b_scale [E, N], fp32 accumulation promoted as cuBLAS's (no fast accumulation)."""
    return torch._scaled_grouped_mm(a, b_t, a_scale, b_scale, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=False)


def sweep(tokens: int, gemm: str, variants: list[str]) -> list[dict]:
    n, k = SHAPES[gemm]
    x, a, a_scale, offs, counts = operands(tokens, n, k)
    w = torch.randn(EXPERTS, n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
    key = {"tokens": tokens, "GEMM": f"{gemm} {n}x{k}"}
    rows = []

    def timed(label: str, ms: float, base: float, error: float | None = None):
        rows.append({**key, "variant": label, "us": f"{ms * 1e3:.0f}", "x bf16": f"{base / ms:.2f}",
                     "rel err": "-" if error is None else f"{error:.1e}"})
        print(rows[-1], flush=True)

    def checked(label: str, got, want) -> float:
        error = rel_error(got, want)
        if not torch.isfinite(got).all() or error > AGREEMENT:
            raise SystemExit(f"{key} {label}: relative error {error:.3g} against the reference")
        return error

    bf16_ms = graph_time_ms(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), [()])
    timed("bf16 torch._grouped_mm", bf16_ms, bf16_ms)
    fp8 = R.quantize_experts(w, "fp8_e4m3", "channel")
    want = torch.cat(dense_by_expert(a, a_scale, counts, fp8.data, fp8.scale))
    timed("dense fp8 kernel expert by expert", graph_time_ms(
        lambda: dense_by_expert(a, a_scale, counts, fp8.data, fp8.scale), [()]), bf16_ms)
    if peer_available():
        row_scales, channel_scales = a_scale.reshape(-1).contiguous(), fp8.scale.reshape(EXPERTS, n).contiguous()
        peer = lambda: scaled_grouped_mm(a, fp8.data.transpose(1, 2), row_scales, channel_scales, offs)
        try:
            got = peer()
        except RuntimeError as refusal:  # a peer that refuses these operands is reported, not the sweep's end
            print(f"{key} torch._scaled_grouped_mm refused: {str(refusal).splitlines()[0]}", flush=True)
        else:
            error = checked("torch._scaled_grouped_mm", got, want)
            timed("torch._scaled_grouped_mm (rowwise, CUTLASS)", graph_time_ms(peer, [()]), bf16_ms, error)
    int4 = R.stack_experts([R.quantize(w[e], "int4", ("group", 128), symmetric=False) for e in range(EXPERTS)])
    w4a8 = lambda: G.grouped_int4_fp8_mm(a, a_scale, offs, int4.data, int4.scale, int4.zero_point)
    out = torch.empty(a.shape[0], n, device=DEVICE, dtype=torch.bfloat16)
    by_expert_route = lambda: G.grouped_int4_fp8_by_expert(out, a, a_scale, offs, int4.data, int4.scale,
                                                           int4.zero_point)
    by_expert = by_expert_route().clone()  # the offsets read on the host
    codes = int4_as_e4m3(int4.data, int4.zero_point)
    for scales, b, b_scale, reference in (("row", fp8.data, fp8.scale, want),
                                          ("channel groups", codes, int4.scale, by_expert)):
        # the scales' layout matters for channel groups only
        for name in (v for v in variants if scales != "row" or "scales" not in VARIANTS[v]):
            config = dict(VARIANTS[name])
            stored = b_scale.transpose(1, 2).contiguous().transpose(1, 2) if config.pop("scales", None) else b_scale
            product = lambda c=config or None, s=stored: G.grouped_fp8_mm(a, a_scale, offs, b, s, config=c)
            error = checked(f"{scales}: {name}", product(), reference)
            timed(f"{scales}: {name}", graph_time_ms(product, [()]), bf16_ms, error)
    error = checked("W4A8 in a graph", graph_output(w4a8, ()), by_expert)
    timed("W4A8 in a graph (codes made e4m3, grouped)", graph_time_ms(w4a8, [()]), bf16_ms, error)
    timed("W4A8 as it runs (expert by expert, cuBLAS)", time_ms(by_expert_route, [()]), bf16_ms)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    print(header())
    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            for gemm in SHAPES:
                rows += sweep(tokens, gemm, args.variants)
    print("\nMixtral-8x7B experts' GEMMs, top-2 rows sorted by expert, us (CUDA graph replay but the last route)")
    print(table(rows))


if __name__ == "__main__":
    main()
