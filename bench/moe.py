"""An MoE layer's experts, Mixtral-8x7B-shaped (8 experts, top-2, hidden 4096, intermediate 14336), at 1 to 4096
tokens: each path's whole experts forward (tokens sorted by expert, rows gathered, both projections, the routing
weights and the per-token sum), in one process on the same routing.

Paths: transformers' experts in bf16 as `grouped_mm` (torch._grouped_mm) and as its eager loop over experts, and
`fxquant.quantize_`'s QuantizedExperts under each recipe. Every output is checked against the bf16 grouped_mm's
before anything is timed. The graph-capturable paths are timed replaying a CUDA graph (GPU time, as decode runs
under reduce-overhead); the eager loop syncs with the host on its routing and is timed as it runs.

    python -m bench.moe [--tokens 1 16 64 512 4096] [--recipes fp8_block int4_wo ...] [--profile 4096]
                        [--chunks 27 30]

--chunks N ...: each weight-only recipe also as a path whose experts, past 128 rows an expert, are dequantized for
grouped_mm 2**N weight elements at a time (`gemm_grouped.EXPERTS_AT_ONCE_ELEMENTS`) instead of the product's.

--profile T: at T tokens, each quantized path's kernels as it runs outside a CUDA graph (where W4A8 past 512 rows an
expert reads the offsets on the host and takes cuBLAS expert by expert, where a graph's capture takes the grouped fp8
kernel over the codes made e4m3): GPU ms a call and the kernels that take most of it, from the profiler over three
calls.
"""

from __future__ import annotations

import argparse
from unittest.mock import patch

import torch
import transformers as T

from bench.common import graph_time_ms, header, table, time_ms
from fxquant.config import RECIPES
from fxquant.kernels import gemm_grouped
from fxquant.modules.quantized_experts import QuantizedExperts

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 4096, 14336, 8, 2
# Relative error of the layer's output against bf16 that each weight format stays under on random weights (fp8:
# about 4%, int8: 1%, 4-bit: 10-13%); more means a wrong product, not rounding.
ERROR_CEILING = {"fp8_e4m3": 0.08, "mxfp8": 0.08, "int8": 0.03, "int4": 0.2, "mxfp4": 0.25, "nvfp4": 0.2}


def experts_module(implementation: str):
    """transformers' MixtralExperts at Mixtral-8x7B's shapes, random bf16 weights on the GPU."""
    config = T.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_local_experts=EXPERTS,
                             num_experts_per_tok=TOP_K)
    config._experts_implementation = implementation
    torch.manual_seed(0)
    with torch.device("cuda"):
        experts = T.models.mixtral.modeling_mixtral.MixtralExperts(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(std=0.02)
    return experts


def routed(tokens: int, seed: int):
    """(hidden states, top-k expert ids, top-k weights) as Mixtral's router makes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, dim=-1).topk(TOP_K, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)


class Chunked(torch.nn.Module):
    """Experts whose weight-only route dequantizes `elements` weight elements at a time."""

    def __init__(self, experts: torch.nn.Module, elements: int):
        super().__init__()
        self.experts, self.elements = experts, elements

    def forward(self, *args):
        with patch.object(gemm_grouped, "EXPERTS_AT_ONCE_ELEMENTS", self.elements):
            return self.experts(*args)


def rel_error(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def graph_output(module, args) -> torch.Tensor:
    """module(*args) captured in a CUDA graph and replayed once: the output of the route that a graph takes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        module(*args)  # warm, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = module(*args)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


def profile_kernels(module, args, calls: int = 3, top: int = 6) -> tuple[float, list[dict]]:
    """(GPU ms a call, the `top` kernels by GPU time with their us a call and count a call), module(*args) run
    `calls` times eagerly under the profiler after one warm call."""
    module(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            module(*args)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels.sort(key=lambda e: e.device_time_total, reverse=True)
    total_ms = sum(e.device_time_total for e in kernels) / calls / 1e3
    return total_ms, [{"kernel": e.key[:90], "us a call": f"{e.device_time_total / calls:.1f}",
                       "launches a call": f"{e.count / calls:g}"} for e in kernels[:top]]


def print_profiles(paths: dict, tokens: int):
    """Each quantized path's GPU time and heaviest kernels at `tokens`, outside a CUDA graph."""
    args = routed(tokens, seed=0)
    for name, module in paths.items():
        if name.startswith("fxquant"):
            total_ms, rows = profile_kernels(module, args)
            print(f"\n{name} at {tokens} tokens, outside a CUDA graph: {total_ms:.3f} GPU ms a call")
            print(table(rows), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="TOKENS",
                        help="at these token counts, each quantized path's kernels outside a CUDA graph")
    parser.add_argument("--chunks", type=int, nargs="*", default=[], metavar="LOG2",
                        help="each weight-only recipe also dequantized for grouped_mm 2**LOG2 elements at a time")
    args = parser.parse_args()
    print(header())
    baseline = experts_module("grouped_mm")
    paths = {"bf16 grouped_mm": baseline}
    for recipe in args.recipes:
        with torch.no_grad():
            paths[f"fxquant {recipe}"] = QuantizedExperts.from_module(baseline, recipe)
        if RECIPES[recipe].kind == "weight_only":
            for log2 in args.chunks:
                paths[f"fxquant {recipe} chunk=2**{log2}"] = Chunked(paths[f"fxquant {recipe}"], 2**log2)
    eager = experts_module("eager")
    eager.load_state_dict(baseline.state_dict())
    paths["bf16 eager loop"] = eager
    weight_bytes = {name: sum(p.numel() * p.element_size() for p in module.parameters())
                    for name, module in paths.items()}

    rows = []
    with torch.no_grad():
        for tokens in args.tokens:
            sets = [routed(tokens, seed) for seed in range(4)]
            want = baseline(*sets[0])
            base_ms = None
            for name, module in paths.items():
                scheme = RECIPES[name.split()[1]] if name.startswith("fxquant") else None
                # W4A8 adds its fp8 activations' rounding to the int4 weights' (0.207 at 16 tokens on the H200)
                ceiling = scheme and ERROR_CEILING[scheme.weight_fmt] + (
                    ERROR_CEILING["fp8_e4m3"] if scheme.kind == "int4_fp8" else 0)
                # as it runs and as a CUDA graph replays it (the route timed, which may differ under capture)
                runs = [module(*sets[0])] + ([] if "eager" in name else [graph_output(module, sets[0])])
                for got, where in zip(runs, ("as it runs", "in a CUDA graph")[:len(runs)], strict=True):
                    error = rel_error(got, want)
                    if not torch.isfinite(got).all() or (scheme and error > ceiling):
                        raise SystemExit(f"{name} at {tokens} tokens {where}: relative error {error:.3g} against "
                                         "bf16")
                timer = time_ms if "eager" in name else graph_time_ms
                ms = timer(module, sets)
                base_ms = base_ms or ms
                rows.append({"tokens": tokens, "path": name, "ms": f"{ms:.3f}", "vs bf16 grouped_mm":
                             f"{base_ms / ms:.2f}x", "rel err vs bf16": f"{error:.4f}",
                             "expert GB": f"{weight_bytes[name] / 1e9:.2f}"})
            print(table(rows[-len(paths):]), flush=True)
        for tokens in args.profile:
            print_profiles(paths, tokens)
    print("\nMoE layer, Mixtral-8x7B experts (8 x [28672, 4096] + 8 x [4096, 14336]), top-2")
    print(table(rows))


if __name__ == "__main__":
    main()
