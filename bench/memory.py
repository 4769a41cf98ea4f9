"""Weight memory of an 8-layer Llama (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 32000, bf16) on CUDA,
per recipe: the backend, which leaves the model's weights in place, and quantize_, which replaces them.

Run: python -m bench.memory [recipe ...] [--layers N]. GB allocated after each step (peak in parentheses where it
matters), and the seconds quantize_ took (the weights quantized on the GPU, synchronized); "ideal" is the quantized
linears plus everything else in bf16, measured as the bytes of the quantize_'d model's parameters and buffers. For
the recipes with a compressed-tensors format, the quantize_'d model is saved with save_quantized and loaded with
load_quantized into a meta skeleton in a fresh process.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time

import torch
import transformers as T

import fxquant
from bench.common import header, llama, llama_config, table
from fxquant.io.compressed_tensors import writable

GB = 1e9


def allocated() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / GB


def peak() -> float:
    return torch.cuda.max_memory_allocated() / GB


def fresh():
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def two_graphs(model, recipe: str) -> tuple[float, float, float, int]:
    """Allocated after the first compiled call, its peak, allocated after a second graph (another batch), graphs."""
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(model, backend="fxquant", options={"recipe": recipe})
    with torch.no_grad():
        out = fn(torch.randint(0, 32000, (1, 128), device="cuda"), use_cache=False)
        del out
        first, first_peak = allocated(), peak()
        out = fn(torch.randint(0, 32000, (4, 128), device="cuda"), use_cache=False)
        del out
    return first, first_peak, allocated(), torch._dynamo.utils.counters["stats"]["unique_graphs"]


def measure(recipe: str, layers: int) -> dict:
    fresh()
    model = llama(layers)
    bf16 = allocated()
    backend_first, backend_peak, backend_second, graphs = two_graphs(model, recipe)
    del model
    fresh()
    model = llama(layers)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fxquant.quantize_(model, {"recipe": recipe})
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    gc.collect()
    after, during = allocated(), peak()
    ideal = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in
                                                       [*model.parameters(), *model.buffers()]}.values()) / GB
    torch.cuda.reset_peak_memory_stats()
    q_first, q_peak, q_second, q_graphs = two_graphs(model, recipe)
    loaded = "-"
    if writable(recipe):
        with tempfile.TemporaryDirectory() as folder:
            fxquant.save_quantized(model, folder)
            done = subprocess.run([sys.executable, "-m", "bench.memory", "--load", folder, "--layers", str(layers)],
                                  capture_output=True, text=True, check=True)
            after_load, load_peak = json.loads(done.stdout.strip().splitlines()[-1])
            loaded = f"{after_load:.2f} ({load_peak:.2f}, {load_peak / ideal:.3f}x ideal)"
    del model
    fresh()
    return {"recipe": recipe, "bf16 model": f"{bf16:.2f}", "ideal": f"{ideal:.2f}",
            "backend 1st graph (peak)": f"{backend_first:.2f} ({backend_peak:.2f})",
            "backend 2nd graph": f"{backend_second:.2f}", "graphs": graphs,
            "quantize_ (peak during)": f"{after:.2f} ({during:.2f})", "quantize_ s": f"{seconds:.2f}",
            "after / ideal": f"{after / ideal:.3f}x", "peak / bf16": f"{during / bf16:.3f}x",
            "quantize_ + 1st graph (peak)": f"{q_first:.2f} ({q_peak:.2f})", "quantize_ + 2nd graph": f"{q_second:.2f}",
            "q graphs": q_graphs, "load_quantized, fresh process (peak)": loaded}


def load(folder: str, layers: int) -> None:
    """In a fresh process: a meta skeleton filled by load_quantized on the GPU; prints [allocated, peak] in GB."""
    config = llama_config(layers)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.device("cuda"):  # rotary frequencies: a non-persistent buffer, in no checkpoint
        model.model.rotary_emb = type(model.model.rotary_emb)(config).to(torch.bfloat16)
    torch.cuda.reset_peak_memory_stats()
    fxquant.load_quantized(model, folder, device="cuda")
    print(json.dumps([allocated(), peak()]))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("recipes", nargs="*", default=list(fxquant.RECIPES))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--load", help="internal: load the checkpoint in this folder and print the memory")
    args = parser.parse_args()
    if args.load:
        load(args.load, args.layers)
        return
    print(header())
    rows = []
    for recipe in args.recipes:
        rows.append(measure(recipe, args.layers))
        print(rows[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
