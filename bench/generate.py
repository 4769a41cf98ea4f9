"""fxquant.generate at the Llama-3-8B shape (32 layers, random bf16 weights), one process: per path and batch, a
prompt of --prefill tokens and --new tokens, the second call timed (the first compiles and captures; a path's
first batch compiles its prefill too).

Columns:
- tokens/s of the whole call (prefill included) and of its decode loop alone;
- GPU ms/step: the captured graphs replayed back to back, timed by CUDA events (the step's time with the host out
  of it), and the decode loop's share of that bound: batch / GPU ms per step, against its tokens/s;
- the host's ms per decode step, outside its waits for the GPU, and whether the step ran as a CUDA graph;
- first token ms: from the call to the first new token in a streamer's hands (a third call, with a streamer);
- with --transformers-batches, the same for transformers' generate() (a static cache, compile_config naming the
  path under reduce-overhead): tokens/s and first token ms.

Paths: nothing (the fxquant backend with nothing quantized: Inductor's bf16 code; transformers' generate() runs
Inductor itself) or a recipe name; either followed by bench.decode's launch settings: +nopdl launches every fxquant
kernel without programmatic dependent launch (fxquant/kernels/dependent_launch.py), +reducekernel sums split GEMMs
in the reduce kernel, to measure what each is worth.

Run: python -m bench.generate [--paths nothing fp8_row int4_wo] [--batches 1 16 64] [--transformers-batches 1]
[--prefill 1024] [--new 256] [--layers 32] [--hidden 4096] [--vocab 128256] [--device cuda]
"""

import argparse
import time

import torch
import transformers as T

import fxquant
from bench.common import LLAMA_3_VOCAB, header, llama, table
from bench.decode import launch_settings, sync
from fxquant.decode_loop import CHECK_EVERY
from fxquant.generation import kept, last_run, release

REPLAYS = 32  # graph replays timed back to back for the GPU's ms per step


class FirstToken(T.generation.BaseStreamer):
    """Notes when the first new token reaches it: generate() and fxquant.generate put the prompt first."""

    def __init__(self):
        self.puts, self.at = 0, None

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self):
        pass


def first_token_ms(call, device: str) -> str:
    streamer = FirstToken()
    sync(device)
    start = time.perf_counter()
    call(streamer)
    return f"{(streamer.at - start) * 1e3:.1f}"


def gpu_ms_per_step(model, prompt) -> float | None:
    """REPLAYS steps of the captured graphs (chunks of CHECK_EVERY, as the loop replays them) back to back after a
    fresh prefill of the prompt (so that their positions stay inside the cache), timed by CUDA events, per step;
    None without a graph."""
    runner = next(iter(kept(model).runners.values()), None)
    if runner is None or runner.graph is None:
        return None
    mask = None if runner.mask is None else torch.ones_like(prompt)  # generate() hands the loop an all-ones mask
    runner.cache.reset()  # as fxquant.generate resets it before each prefill
    runner.start(prompt, mask, None if mask is None else mask.cumsum(-1) - 1, None)
    runner.graph.replay()  # the first replay after a prefill waits for it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph, steps = (runner.chunk_graph, CHECK_EVERY) if runner.chunk_graph is not None else (runner.graph, 1)
    start.record()
    for _ in range(REPLAYS // steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPLAYS


def row(model, path: str, batch: int, args) -> dict:
    with launch_settings(path):  # the graphs it captures keep them
        return planned_row(model, path, batch, args)


def planned_row(model, path: str, batch: int, args) -> dict:
    recipe = path.split("+")[0]
    options = {"include": []} if recipe == "nothing" else {"recipe": recipe}
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
    decode_rate = batch * stats.steps / stats.wall_s
    result = {"path": path, "batch": batch, "first call s": f"{first:.0f}", "new tokens": stats.tokens,
              "tokens/s": f"{out[:, args.prefill:].numel() / whole:.0f}", "decode tokens/s": f"{decode_rate:.0f}",
              "decode ms/step": f"{stats.wall_s / stats.steps * 1e3:.3f}"}
    gpu_ms = gpu_ms_per_step(model, prompt) if args.device == "cuda" else None
    if gpu_ms is not None:
        result |= {"GPU ms/step": f"{gpu_ms:.3f}", "x bound": f"{decode_rate / (batch / gpu_ms * 1e3):.3f}"}
    result |= {"host ms/step": f"{stats.host_s / stats.steps * 1e3:.3f}", "graph": "yes" if stats.graph else "no",
               "first token ms": first_token_ms(lambda s: fxquant.generate(model, prompt, streamer=s, **kwargs),
                                                args.device)}
    if batch in args.transformers_batches:
        result |= transformers_generate(model, recipe, prompt, args)
    return result


def transformers_generate(model, path: str, prompt, args) -> dict:
    """transformers' generate() over the same prompt: a static cache, the step compiled under reduce-overhead by
    Inductor (path nothing) or the fxquant backend; the second call timed, a third with a streamer."""
    if path == "nothing":
        config = T.CompileConfig(backend="inductor", mode="reduce-overhead", dynamic=False)
    else:  # torch.compile takes mode= or options=, not both: fxquant's options carry it
        config = T.CompileConfig(backend="fxquant", mode=None, dynamic=False,
                                 options={"recipe": path, "mode": "reduce-overhead"})
    kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, compile_config=config,
                  cache_implementation="static")
    model.generate(prompt, **kwargs)  # compiles
    sync(args.device)
    start = time.perf_counter()
    model.generate(prompt, **kwargs)
    sync(args.device)
    rate = prompt.shape[0] * args.new / (time.perf_counter() - start)
    first = first_token_ms(lambda s: model.generate(prompt, streamer=s, **kwargs), args.device)
    return {"generate() tokens/s": f"{rate:.0f}", "generate() first token ms": first}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", nargs="+", default=["nothing", "fp8_row", "int4_wo"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--transformers-batches", type=int, nargs="*", default=[1],
                        help="batches whose row times transformers' generate() too")
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
