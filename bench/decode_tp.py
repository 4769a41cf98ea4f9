"""Decode at tensor-parallel degree N: the Llama of bench/decode.py (by default Llama-3-8B's shape) sharded with
DTensor over the ranks torchrun starts, as transformers' Llama tp_plan shards it (q/k/v and gate/up column parallel,
o and down row parallel; embeddings, norms and the LM head replicated), each path compiled on every rank. Rank 0
prints, per path and batch, the median ms per decode step over a StaticCache holding the prompt, and the speed-up
over Inductor bf16 at the same degree in the same run; with the single-GPU speed-up from bench/decode.py, this gives
the share of it a path keeps at TP=N.

Run on N GPUs (NCCL): torchrun --nproc-per-node N -m bench.decode_tp [path ...] [--batches 1 16] [--prefill 1024]
On the CPU (gloo), to check the script: torchrun --nproc-per-node 2 -m bench.decode_tp --device cpu --layers 2
--hidden 1024 --vocab 512 --prefill 16 --steps 8 --mode default (hidden 1024: 2 KV heads, one per rank)
paths: inductor, fxquant:<recipe> (default: inductor fxquant:fp8_row).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from bench.common import header, llama, table
from bench.decode import CHECK_STEPS, Decoder, compiled_forward, cosine, step_options

COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def tp_plan(model) -> dict:
    """transformers' Llama tp_plan for the decoder layers' linears."""
    return {name: ColwiseParallel() if name.endswith(COLUMN) else RowwiseParallel()
            for name, _ in model.named_modules() if name.endswith(COLUMN + ROW)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="*", default=["inductor", "fxquant:fp8_row"])
    step_options(parser, batches=[1, 16], steps=24)
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    if rank == 0 and args.device == "cuda":
        print(header(), flush=True)
    model = llama(args.layers, args.hidden, device, args.vocab)  # the same seed on every rank: the same weights
    parallelize_module(model, init_device_mesh(args.device, (world,)), tp_plan(model))
    generator = torch.Generator().manual_seed(1)
    max_len, rows = args.prefill + args.steps, []
    with torch.no_grad():
        inputs = {batch: (torch.randint(0, args.vocab, (batch, args.prefill), generator=generator).to(device),
                          torch.randint(0, args.vocab, (batch, args.steps), generator=generator).to(device))
                  for batch in args.batches}
        eager = {batch: Decoder(model, model, args.device, max_len).steps(prompt, tokens[:, :CHECK_STEPS])[0]
                 for batch, (prompt, tokens) in inputs.items()}
        baseline = {}
        for path in args.paths:
            torch._dynamo.reset()
            runner, forward, _ = compiled_forward(model, path, args.mode)
            decoder = Decoder(runner, forward, args.device, max_len)
            for batch, (prompt, tokens) in inputs.items():
                logits, _, finished = decoder.steps(prompt, tokens)
                ms = statistics.median(finished[CHECK_STEPS:])
                baseline.setdefault(batch, ms if path == "inductor" else None)
                check = min(cosine(got, want) for got, want in zip(logits[:CHECK_STEPS], eager[batch], strict=True))
                speedup = f" ({baseline[batch] / ms:.2f}x)" if baseline[batch] else ""
                rows.append({"path": path, "TP": world, "batch": batch, "check": f"min cos {check:.4f}",
                             "decode ms": f"{ms:.3f}{speedup}", "tokens/s": f"{batch * 1e3 / ms:.0f}"})
                if rank == 0:
                    print(rows[-1], flush=True)
    if rank == 0:
        print(table(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
