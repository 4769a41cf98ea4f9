"""The chain of fp8_row decode layers that `bench.l2_ahead`, `bench.quant_prologue`, `bench.chain_tiles` and
`bench.chain_parts` time: 32 Llama-3-8B layers replayed from one CUDA graph, each kernel launched dependent as the
decode step launches it, without the host or Inductor.

Each layer quantizes its input per token, runs the merged q/k/v product (6144 x 4096), attends over its own bf16
cache of `--context` tokens with fxquant's decode attention (its output quantized in the kernel, as the backend runs
it), runs o_proj (4096 x 4096), quantizes, runs the merged gate/up product (28672 x 4096), quantizes silu(gate) * up
and runs down_proj (4096 x 14336) into the residual. The weights are `bench.split_sums`' (e4m3 codes of N(0, 1),
per-channel scales 1 / sqrt(K)). `time_variants` times named variants of it a batch at a time: microseconds a layer,
and the layer's weight bytes (218 MB) over that time as a share of the copy bandwidth measured in the same process.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.common import copy_bandwidth_gbs, graph_time_ms, header, table
from bench.split_sums import HIDDEN, INTER, SHAPES, weights
from fxquant.kernels.decode_attention import decode_attention_quantized
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows

HEADS_Q, HEADS_KV, DIM = 32, 8, 128
DEVICE = "cuda"  # where the residual and the caches are made (a test makes them on the CPU)
LAYER_BYTES = sum(n * k for n, k in SHAPES)  # one byte a code; the scales are 0.1% of it


def caches(layers: int, batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's bf16 K and V, [batch, KV heads, context, head dim]."""
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    return [tuple(torch.randn(batch, HEADS_KV, context, DIM, device=DEVICE, dtype=torch.bfloat16, generator=gen)
                  for _ in range(2)) for _ in range(layers)]


def chain(h: torch.Tensor, layers, kv, before_attention: Callable | None = None, quant_gemm: Callable | None = None,
          tiles: dict | None = None) -> torch.Tensor:
    """The layers' chain from the residual h [batch, 4096]. before_attention(o_proj's weight): launched after the
    q/k/v product; quant_gemm(x, w, w_scale): the q/k/v and gate/up products with their input's per-token quantizer,
    in place of quantize_fp8_rows then the GEMM; tiles: {(N, K): config} in place of the fp8 GEMM's tiles for the
    weights of that shape."""
    tiles = tiles or {}
    gemm = lambda a, a_scale, w, w_scale: fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16,
                                                        tiles.get(tuple(w.shape)))
    quant_gemm = quant_gemm or (lambda x, w, w_scale: gemm(*quantize_fp8_rows(x, HIDDEN), w, w_scale))
    batch = h.shape[0]
    for ((w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down)), (k, v) in zip(layers, kv, strict=True):
        qkv = quant_gemm(h, w_qkv, s_qkv)
        if before_attention is not None:
            before_attention(w_o)
        q = qkv[:, :HIDDEN].reshape(batch, HEADS_Q, 1, DIM)
        codes, scales = decode_attention_quantized(q, k, v, None, DIM ** -0.5, 0.0, None, None, None, None, 0)
        o = gemm(codes.reshape(batch, HIDDEN), scales.reshape(batch, 1), w_o, s_o)
        gate, up = quant_gemm(o, w_gu, s_gu).chunk(2, dim=-1)
        h = h + gemm(*silu_mul_quantize_fp8_rows(gate, up, INTER), w_down, s_down)
    return h


def arguments(doc: str) -> argparse.ArgumentParser:
    """The chain's command line: --layers, --batches, --context, and --variants to time some of them by name."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", help="the variants to time, by name (default: all)")
    return parser


def same_bits(name: str, out: torch.Tensor, first: torch.Tensor | None, state: dict) -> None:
    """A `time_variants` check: each variant's chain is finite, not all zero, and the first variant's bits."""
    assert torch.isfinite(out).all() and out.abs().max() > 0, f"B{state['batch']} {name}"
    assert first is None or torch.equal(out, first), f"B{state['batch']} {name}: the chain's bits moved"


def time_variants(args, variants: dict[str, Callable], check: Callable | None = None) -> list[dict[str, float]]:
    """For each batch, each variant run(state) of the chain, where state holds the batch's "h", "layers", "kv" and
    "batch": first run once and passed to check(name, out, first variant's out, state) (default: finite and not
    all zero), then timed from a CUDA graph; a variant whose launch raises a RuntimeError or ValueError (a plan
    the compiler refuses) is reported and left out. Prints each time as it comes and the table at the end; returns,
    by batch, the microseconds a layer of each variant run, of those named in --variants (all where it names
    none)."""
    print(header())
    bandwidth = copy_bandwidth_gbs()
    layers = weights(args.layers)
    variants = {name: run for name, run in variants.items() if not args.variants or name in args.variants}
    results, rows = [], []
    for batch in args.batches:
        state = dict(h=torch.randn(batch, HIDDEN, device=DEVICE, dtype=torch.bfloat16), layers=layers,
                     kv=caches(args.layers, batch, args.context), batch=batch)
        us, first = {}, None
        for name, run in variants.items():
            try:
                out = run(state)
            except (RuntimeError, ValueError) as exc:  # a plan the compiler or the GPU refuses (shared memory)
                print(batch, name, f"not run: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            if check is not None:
                check(name, out, first, state)
            else:
                assert torch.isfinite(out).all() and out.abs().max() > 0, f"B{batch} {name}"
            first = out if first is None else first
            us[name] = 1e3 * graph_time_ms(lambda r=run: r(state), [()]) / args.layers
            print(batch, name, f"{us[name]:.1f} us", flush=True)
        results.append(us)
        rows.append({"B": batch, **{name: f"{us[name]:.1f} us, "
                                          f"{100 * LAYER_BYTES / (us[name] * 1e-6) / (bandwidth * 1e9):.0f}%"
                                    if name in us else "-" for name in variants}})
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {args.layers} layers over {args.context} cached tokens; "
          "us a layer, the weights' bytes over that time")
    print(table(rows))
    return results
