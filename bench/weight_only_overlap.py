"""A probe for the weight-only prefill: the product's route (the weight dequantized to bf16, then cuBLAS) with the
dequantization of the next row chunk running on a side stream while cuBLAS multiplies the chunk before it.

Past M = 128 the product dequantizes the whole weight before its one GEMM (docs/decisions/0025): at M = 1024 the
dequantization, a memory-bound kernel, costs 0.76-0.81x of bf16 cuBLAS's time on the Llama shapes (H100, 2026-12-06),
while the GEMM beside it is bound by the tensor cores. Here the weight is cut into `chunks` row chunks, all
dequantized in order on a side stream; the main stream multiplies chunk i once its dequantization is done, so only
the first chunk's is exposed if the two kernels share the GPU. cuBLAS's kernels may hold every SM, so an
`--carveout S` row also asks cuBLAS to leave S SMs free (torch's experimental SM carveout, where torch has it).

Run: python -m bench.weight_only_overlap [--ms 1024 4096] [--chunks 2 4 8] [--carveout 16]
(correctness against the product's route first: the same bf16 weight and the same cuBLAS, so the same bits within a
column block's tile order, checked within 1e-2 of the largest output; then the times from CUDA-graph replay.)
"""

from __future__ import annotations

import torch

from bench.common import header, rows_against_bf16, table, values_after
from fxquant.kernels.dequantize_weight import dequantize_weight
from fxquant.kernels.gemm_weight_only import weight_only_mm, weight_operands
from fxquant.numerics import reference as R

GROUP = 128
SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)]  # o, merged q/k/v, merged gate/up, down


def overlapped_mm(a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, N: int,
                  chunks: int, side: torch.cuda.Stream) -> torch.Tensor:
    """a [M, K] @ W.T for int4 W (codes and scales as `weight_operands` gives them, groups of 128 with zero points),
    W dequantized to a's dtype chunk by chunk on `side` while the current stream multiplies the chunks before."""
    (M, K), rows = a.shape, N // chunks
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    main = torch.cuda.current_stream()
    side.wait_stream(main)  # the side stream starts after what came before this product
    done = []
    with torch.cuda.stream(side):
        for n0 in range(0, N, rows):
            w = dequantize_weight(codes[n0:n0 + rows], scale[n0:n0 + rows], "int4", GROUP, K, a.dtype,
                                  zero_point=zero_point[n0:n0 + rows])
            ready = torch.cuda.Event()
            ready.record(side)
            done.append((n0, w, ready))
    for n0, w, ready in done:
        main.wait_event(ready)
        w.record_stream(main)  # the chunk is freed only after the GEMM that reads it
        torch.mm(a, w.T, out=out[:, n0:n0 + rows])
    main.wait_stream(side)  # joined: a graph capture ends with every stream it forked
    return out


def carved(fn, sms: int):
    """fn with cuBLAS asked to leave `sms` SMs free while it runs."""
    def run():
        torch._C._set_sm_carveout_experimental(sms)
        try:
            return fn()
        finally:
            torch._C._set_sm_carveout_experimental(None)
    return run


def main():
    print(header())
    ms = [int(v) for v in values_after("--ms", ["1024", "4096"])]
    chunk_counts = [int(v) for v in values_after("--chunks", ["2", "4", "8"])]
    carveouts = [int(v) for v in values_after("--carveout", [])]
    if carveouts and not hasattr(torch._C, "_set_sm_carveout_experimental"):
        print(f"torch {torch.__version__} has no SM carveout: the --carveout rows are left out")
        carveouts = []
    side = torch.cuda.Stream()
    rows = []
    for n, k in SHAPES:
        q = R.quantize(torch.randn(n, k, device="cuda") * 0.02, "int4", ("group", GROUP))
        w_bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ms:
            a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            codes, scale = weight_operands(a, q.data, q.scale, "int4", GROUP, n)
            routed = lambda: weight_only_mm(a, q.data, q.scale, "int4", GROUP, n, zero_point=q.zero_point)
            runs = {"bf16": lambda: a @ w_bf16.T, "dequantized": routed}
            for c in chunk_counts:
                runs[f"{c} chunks"] = lambda c=c: overlapped_mm(a, codes, scale, q.zero_point, n, c, side)
                for sms in carveouts:
                    runs[f"{c} chunks, {sms} SMs left"] = carved(runs[f"{c} chunks"], sms)
            reference = routed().float()
            for name, fn in list(runs.items())[2:]:
                error = ((fn().float() - reference).abs().max() / reference.abs().max()).item()
                if not error < 1e-2:  # the same bf16 operands through cuBLAS, by column blocks
                    print(f"{name}, {n}x{k} at M = {m}: off the product's route by {error:.1e}; not timed")
                    del runs[name]
            rows += rows_against_bf16(runs, **{"N x K": f"{n}x{k}", "M": m})
    print(f"int4 groups of {GROUP} with zero points, the codes in rows; each "
          "chunked row agrees with the product's route within 1e-2 of its largest output (one that does not is "
          "named above, untimed)")
    print(table(rows))


if __name__ == "__main__":
    main()
