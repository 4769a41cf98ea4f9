"""The next GEMM's weights asked of the L2 while decode attention runs: a probe of the HBM time that attention leaves
idle at small batch, in a chain of fp8_row decode layers (Llama-3-8B shapes) replayed from a CUDA graph.

Each layer quantizes its input per token, runs the merged q/k/v product (6144 x 4096), attends over its own bf16
cache of `--context` tokens with fxquant's decode attention (the output quantized in the kernel, as the backend
runs it), runs o_proj (4096 x 4096), quantizes, runs the merged gate/up product (28672 x 4096), quantizes
silu(gate) * up and runs down_proj (4096 x 14336) into the residual. At B1 over 1024 tokens attention reads 4 MB in
about 9 us: 40 MB of HBM time during which nothing else reads. The variants put one kernel before attention that
asks the L2 for the o_proj weight (16.8 MB, read whole by the GEMM after attention), with the bulk prefetch
(`cp.async.bulk.prefetch.L2`, one instruction a chunk) or one `prefetch.global.L2` a 128-byte line, launched
dependent (it asks, lets attention launch, then waits for the q/k/v product, so attention still reads what that
wrote). Two more variants time the asking alone: the 4 KB kernel over as many bytes that no GEMM reads, and over
one chunk. A prefetch is a hint: every variant's chain gives the same bits (checked first). The table gives
microseconds a layer and the layer's weight bytes over that time as a share of the copy bandwidth.

With --prefetch-steps N the GEMMs' own prefetch before their wait asks for N K steps of each program's weights in
place of `dependent_launch.PREFETCH_STEPS` (set before any kernel compiles; Triton keys its cache on the value), and
--variants names the variants to time.

Run: python -m bench.l2_ahead [--layers 32] [--batches 1 16] [--context 1024] [--chunks 4096 16384 65536]
     [--prefetch-steps 8] [--variants none ...]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import fxquant.kernels.dependent_launch as dependent_launch
from bench.common import copy_bandwidth_gbs, graph_time_ms, header, table
from fxquant.kernels.decode_attention import decode_attention_quantized
from fxquant.kernels.dependent_launch import await_previous, launch_options, start_next
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows

HIDDEN, INTER, QKV, HEADS_Q, HEADS_KV, DIM = 4096, 14336, 6144, 32, 8, 128
SHAPES = ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER))  # (N, K) of each GEMM of a layer
LINE = 128  # bytes of an L2 line


@triton.jit
def _ask_l2_kernel(ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr, BULK: tl.constexpr,
                   PDL: tl.constexpr):
    starts = (tl.program_id(0) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    starts = tl.minimum(starts, nbytes - CHUNK)  # the last chunks ask for the tail again
    if BULK:
        tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                  [ptr + starts, tl.full([PER_PROGRAM], CHUNK, tl.int32)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptr + starts],
                                  dtype=tl.int32, is_pure=False, pack=1)
    start_next(PDL)
    await_previous(PDL)  # ends after the kernel before it: the one after still waits for what that one wrote


def ask_l2(weight: torch.Tensor, chunk: int, bulk: bool) -> None:
    """Ask the L2 for `weight`'s bytes (contiguous), `chunk` bytes an instruction (bulk) or a line each."""
    nbytes = weight.numel() * weight.element_size()
    chunk = chunk if bulk else LINE
    per_program = 1024 if not bulk else 128
    chunks = triton.cdiv(nbytes, chunk)
    _ask_l2_kernel[(triton.cdiv(chunks, per_program),)](weight, nbytes, CHUNK=chunk, PER_PROGRAM=per_program,
                                                       BULK=bulk, num_warps=4, **launch_options(weight.device))


def layer_weights(layers: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [[(torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn),
              torch.full((n, 1), k ** -0.5, device="cuda")) for n, k in SHAPES] for _ in range(layers)]


def caches(layers: int, batch: int, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(1)
    return [tuple(torch.randn(batch, HEADS_KV, context, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
                  for _ in range(2)) for _ in range(layers)]


def chain(h: torch.Tensor, layers, kv, ahead: tuple | None, quant_gemm=None, tiles: dict | None = None) -> torch.Tensor:
    """The layers' chain; ahead: (chunk, bulk[, what]) to ask the L2 for o_proj's weight before attention (or for
    `what`, a tensor no kernel reads, to time the asking alone), or None. quant_gemm(x, w, w_scale): the q/k/v and
    gate/up products with their input's per-token quantizer, in place of quantize_fp8_rows then the GEMM. tiles:
    {(N, K): config} in place of the fp8 GEMM's tiles for the weights of that shape."""
    tiles = tiles or {}
    gemm = lambda a, a_scale, w, w_scale: fp8_scaled_mm(a, a_scale, w, w_scale, None, torch.bfloat16,
                                                        tiles.get(tuple(w.shape)))
    quant_gemm = quant_gemm or (lambda x, w, w_scale: gemm(*quantize_fp8_rows(x, HIDDEN), w, w_scale))
    batch = h.shape[0]
    for ((w_qkv, s_qkv), (w_o, s_o), (w_gu, s_gu), (w_down, s_down)), (k, v) in zip(layers, kv, strict=True):
        qkv = quant_gemm(h, w_qkv, s_qkv)
        if ahead is not None:
            chunk, bulk, *what = ahead
            ask_l2(what[0] if what else w_o, chunk, bulk)
        q = qkv[:, :HIDDEN].reshape(batch, HEADS_Q, 1, DIM)
        codes, scales = decode_attention_quantized(q, k, v, None, DIM ** -0.5, 0.0, None, None, None, None, 0)
        o = gemm(codes.reshape(batch, HIDDEN), scales.reshape(batch, 1), w_o, s_o)
        gate, up = quant_gemm(o, w_gu, s_gu).chunk(2, dim=-1)
        h = h + gemm(*silu_mul_quantize_fp8_rows(gate, up, INTER), w_down, s_down)
    return h


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--prefetch-steps", type=int, help="K steps each GEMM program asks of the L2 (a power of 2)")
    parser.add_argument("--variants", nargs="+", help="the variants to time, by name (default: all)")
    args = parser.parse_args()
    if args.prefetch_steps:
        dependent_launch.PREFETCH_STEPS = tl.constexpr(args.prefetch_steps)
    print(header())
    print(f"the GEMMs' own prefetch: {dependent_launch.PREFETCH_STEPS.value} K steps")
    bandwidth = copy_bandwidth_gbs()
    layers = layer_weights(args.layers)
    layer_bytes = sum(n * k for n, k in SHAPES)  # one byte a code; the scales are 0.1% of it
    share = lambda us: f"{us:.1f} us, {100 * layer_bytes / (us * 1e-6) / (bandwidth * 1e9):.0f}%"
    unread = torch.empty(HIDDEN, HIDDEN, device="cuda", dtype=torch.float8_e4m3fn)  # as large as o_proj's weight
    variants = {"none": None, **{f"bulk {c // 1024} KB": (c, True) for c in args.chunks}, "lines": (LINE, False),
                # the asking's own cost: the same kernel over bytes no GEMM reads, and over one chunk
                "bulk 4 KB, unread": (4096, True, unread), "one chunk, unread": (4096, True, unread[:1])}
    variants = {name: ahead for name, ahead in variants.items() if not args.variants or name in args.variants}
    rows = []
    for batch in args.batches:
        kv = caches(args.layers, batch, args.context)
        h = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        want = chain(h, layers, kv, None)
        assert torch.isfinite(want).all() and want.abs().max() > 0
        row = {"B": batch}
        for name, ahead in variants.items():
            assert torch.equal(chain(h, layers, kv, ahead), want), f"B{batch} {name}: the chain's bits moved"
            row[name] = share(1e3 * graph_time_ms(lambda: chain(h, layers, kv, ahead), [()]) / args.layers)
            print(batch, name, row[name], flush=True)
        rows.append(row)
    print(f"copy bandwidth {bandwidth:.0f} GB/s; {args.layers} layers over {args.context} cached tokens; "
          "us a layer, the weights' bytes over that time")
    print(table(rows))


if __name__ == "__main__":
    main()
