"""The next GEMM's weights asked of the L2 while decode attention runs: a probe of the HBM time that attention leaves
idle at small batch, in the chain of fp8_row decode layers of `bench.layer_chain`.

At B1 over 1024 tokens attention reads 4 MB in about 9 us: 40 MB of HBM time during which nothing else reads. The
variants put one kernel before attention that asks the L2 for the o_proj weight (16.8 MB, read whole by the GEMM
after attention), with the bulk prefetch (`cp.async.bulk.prefetch.L2`, one instruction a chunk) or one
`prefetch.global.L2` a 128-byte line, launched dependent (it asks, lets attention launch, then waits for the q/k/v
product, so attention still reads what that wrote). Two more variants time the asking alone: the 4 KB kernel over
as many bytes that no GEMM reads, and over one chunk. A prefetch is a hint: every variant's chain gives the same
bits (checked first).

With --prefetch-steps N the GEMMs' own prefetch before their wait asks for N K steps of each program's weights in
place of `dependent_launch.PREFETCH_STEPS` (set before any kernel compiles; Triton keys its cache on the value).

Run: python -m bench.l2_ahead [--layers 32] [--batches 1 16] [--context 1024] [--chunks 4096 16384 65536]
     [--prefetch-steps 8] [--variants none ...]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import fxquant.kernels.dependent_launch as dependent_launch
from bench.layer_chain import HIDDEN, arguments, chain, same_bits, time_variants
from fxquant.kernels.dependent_launch import await_previous, launch_options, start_next

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


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--prefetch-steps", type=int, help="K steps each GEMM program asks of the L2 (a power of 2)")
    args = parser.parse_args()
    if args.prefetch_steps:
        dependent_launch.PREFETCH_STEPS = tl.constexpr(args.prefetch_steps)
    print(f"the GEMMs' own prefetch: {dependent_launch.PREFETCH_STEPS.value} K steps")
    unread = torch.empty(HIDDEN, HIDDEN, device="cuda", dtype=torch.float8_e4m3fn)  # as large as o_proj's weight
    asked = {**{f"bulk {c // 1024} KB": lambda w, c=c: ask_l2(w, c, True) for c in args.chunks},
             "lines": lambda w: ask_l2(w, LINE, False),
             # the asking's own cost: the same kernel over bytes no GEMM reads, and over one chunk
             "bulk 4 KB, unread": lambda w: ask_l2(unread, 4096, True),
             "one chunk, unread": lambda w: ask_l2(unread[:1], 4096, True)}
    variants = {"none": lambda s: chain(s["h"], s["layers"], s["kv"])}
    variants.update({name: lambda s, a=ask: chain(s["h"], s["layers"], s["kv"], before_attention=a)
                     for name, ask in asked.items()})
    time_variants(args, variants, same_bits)  # a prefetch is a hint


if __name__ == "__main__":
    main()
