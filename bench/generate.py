"""fxquant.generate at the Llama-3-8B shape (32 layers, random bf16 weights), one process: per path and batch, a
prompt of --prefill tokens and --new tokens, the second call timed (the first compiles and captures; a path's
first batch compiles its prefill too).

Columns: tokens/s of the whole call (prefill included), tokens/s of its decode loop, the host's ms per decode step
outside its waits for the GPU, and whether the step ran as a CUDA graph. Paths: nothing (the fxquant backend with
nothing quantized: Inductor's bf16 code) or a recipe name.

Run: python -m bench.generate [--paths nothing fp8_row int4_wo] [--batches 1 16 64] [--prefill 1024] [--new 256]
[--layers 32] [--hidden 4096] [--vocab 128256] [--device cuda]
"""

import argparse
import time

import torch

import fxquant
from bench.common import LLAMA_3_VOCAB, header, llama, table
from bench.decode import sync
from fxquant.generation import last_run, release


def row(model, path: str, batch: int, args) -> dict:
    options = {"include": []} if path == "nothing" else {"recipe": path}
    prompt = torch.randint(0, args.vocab, (batch, args.prefill), device=args.device)
    kwargs = dict(max_new_tokens=args.new, do_sample=False, options=options)
    start = time.perf_counter()
    fxquant.generate(model, prompt, **kwargs)
    first = time.perf_counter() - start
    sync(args.device)
    start = time.perf_counter()
    out = fxquant.generate(model, prompt, **kwargs)
    sync(args.device)
    whole, stats = time.perf_counter() - start, last_run(model)
    return {"path": path, "batch": batch, "first call s": f"{first:.0f}", "new tokens": stats.tokens,
            "tokens/s": f"{out[:, args.prefill:].numel() / whole:.0f}",
            "decode tokens/s": f"{batch * stats.steps / stats.wall_s:.0f}",
            "decode ms/step": f"{stats.wall_s / stats.steps * 1e3:.3f}",
            "host ms/step": f"{stats.host_s / stats.steps * 1e3:.3f}", "graph": "yes" if stats.graph else "no"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", nargs="+", default=["nothing", "fp8_row", "int4_wo"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=LLAMA_3_VOCAB)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cuda":
        print(header())
    model, rows = llama(args.layers, args.hidden, args.device, args.vocab), []
    model.generation_config.eos_token_id = None  # every call decodes all --new tokens
    with torch.no_grad():
        for path in args.paths:
            release(model)  # the last path's cache, graph and compiled forwards
            torch._dynamo.reset()
            for batch in args.batches:
                rows.append(row(model, path, batch, args))
                print(rows[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
