"""Decode as users run it: a Llama built from a config (8 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV
heads, vocab 32000, bf16) prefills a prompt into a transformers StaticCache, then decodes one token per step with
its forward compiled per path. Before anything is timed, each path's logits over the first steps are checked
against eager's on the same tokens (teacher-forced); then decode steps are timed (median ms per step, tokens/s).
transformers' generate() with cache_implementation="static" and compile_config naming the path is timed beside it.

Run: python -m bench.decode [path ...] [--batches 1 16 64] [--prefill 1024] [--steps 32] [--mode reduce-overhead]
paths: inductor, fxquant:<recipe> (default: inductor and every recipe). Each (path, batch) runs in its own process,
so one that fails or crashes leaves the others' rows.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time

import torch
import transformers as T

import fxquant
from bench.common import header, llama, table

CHECK_STEPS = 4  # decode steps whose logits are compared with eager's before timing


def compiled_forward(model, path: str, mode: str):
    if path == "inductor":
        return torch.compile(model.forward, mode=mode)
    recipe = path.split(":", 1)[1]
    return torch.compile(model.forward, backend="fxquant", options={"recipe": recipe, "mode": mode})


def cache_keyword(model) -> str:
    """transformers renamed past_key_values to cache; take whichever this version's forward has."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def decode(model, forward, prompt, steps, device: str, timed: int) -> tuple[torch.Tensor, list[float]]:
    """Prefill, then one step per column of `steps`: the first CHECK_STEPS logits, and ms of the last `timed` steps."""
    cache = T.StaticCache(config=model.config, max_cache_len=prompt.shape[1] + steps.shape[1])
    keyword, length = cache_keyword(model), prompt.shape[1]
    logits, times = [], []
    with torch.no_grad():
        forward(input_ids=prompt, cache_position=torch.arange(length, device=device), use_cache=True,
                **{keyword: cache})
        for i in range(steps.shape[1]):
            sync(device)
            start = time.perf_counter()
            out = forward(input_ids=steps[:, i:i + 1], cache_position=torch.tensor([length + i], device=device),
                          use_cache=True, **{keyword: cache}).logits
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
            if i < CHECK_STEPS:
                logits.append(out[:, -1].float())
    return torch.stack(logits), times[-timed:]


def one(path: str, batch: int, args) -> dict:
    model = llama(args.layers, args.hidden, args.device)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 32000, (batch, args.prefill), generator=generator).to(args.device)
    steps = torch.randint(0, 32000, (batch, args.steps + CHECK_STEPS), generator=generator).to(args.device)
    eager, _ = decode(model, model.forward, prompt, steps[:, :CHECK_STEPS], args.device, 0)
    forward = compiled_forward(model, path, args.mode)
    start = time.perf_counter()
    got, times = decode(model, forward, prompt, steps, args.device, args.steps)
    first = time.perf_counter() - start
    cos = min(float(torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0))
              for g, e in zip(got, eager, strict=True))
    if not torch.isfinite(got).all():
        raise RuntimeError(f"{path}: non-finite logits")
    ms = statistics.median(times)
    row = {"path": path, "batch": batch, "min logit cosine to eager": f"{cos:.4f}", "ms / step": f"{ms:.3f}",
           "tokens/s": f"{batch * 1e3 / ms:.0f}", "first loop s": f"{first:.1f}"}
    row["generate() tokens/s"] = generate_rate(model, path, prompt, args)
    return row


def generate_rate(model, path: str, prompt, args) -> str:
    """transformers' generate() with a static cache and the path as its compile_config."""
    if path == "inductor":
        config = T.CompileConfig(backend="inductor", mode=args.mode)
    else:  # torch.compile takes mode= or options=, not both: fxquant's options carry the mode
        config = T.CompileConfig(backend="fxquant", mode=None,
                                 options={"recipe": path.split(":", 1)[1], "mode": args.mode})
    kwargs = dict(max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False,
                  cache_implementation="static", compile_config=config)
    with torch.no_grad():
        model.generate(prompt, **kwargs)  # compiles
        sync(args.device)
        start = time.perf_counter()
        model.generate(prompt, **kwargs)
        sync(args.device)
    return f"{prompt.shape[0] * args.steps / (time.perf_counter() - start):.0f}"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="*", default=["inductor", *(f"fxquant:{r}" for r in fxquant.RECIPES)])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--mode", default="reduce-overhead", choices=["default", "reduce-overhead"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--one", help="internal: run one path at --batches[0] and print its row as JSON")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.batches[0], args)))
        return
    if args.device == "cuda":
        print(header())
    rows = []
    for path in args.paths:
        for batch in args.batches:
            command = [sys.executable, "-m", "bench.decode", "--one", path, "--batches", str(batch),
                       *(f"--{k}={v}" for k, v in vars(args).items() if k in ("layers", "hidden", "prefill", "steps",
                                                                            "mode", "device"))]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                last = (done.stderr.strip().splitlines() or ["no output"])[-1][:120]
                rows.append({"path": path, "batch": batch, "min logit cosine to eager": f"failed (rc "
                             f"{done.returncode}): {last}", "ms / step": "-", "tokens/s": "-", "first loop s": "-",
                             "generate() tokens/s": "-"})
            else:
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
