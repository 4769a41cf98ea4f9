"""End to end on the GPU: a 4-layer Llama (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 32000)
from config, bf16, random weights; with --mixtral, a 4-layer Mixtral of the same attention whose MLPs are Mixtral-8x7B's
experts (8 experts of intermediate 14336, top-2, transformers' grouped_mm experts). Eager, Inductor bf16, torchao fp8
per-row (when torchao imports) and fxquant recipes; first-compile time, latency, and the GPU kernel time inside it
(profiler).

Run: python -m bench.e2e [--mixtral] [--reduce-overhead] [--no-torchao] [--top-kernels] [recipe ...]
"""

from __future__ import annotations

import sys
import time

import torch
import triton.testing
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

import fxquant  # noqa: F401  (registers the backend)
from bench import peers
from bench.common import header, table

SHAPES = {"prefill 1x2048": (1, 2048), "decode B16x1": (16, 1), "decode B64x1": (64, 1)}


def build(mixtral: bool):
    shapes = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  num_hidden_layers=4, vocab_size=32000)
    config = MixtralConfig(**shapes, num_local_experts=8, num_experts_per_tok=2) if mixtral else LlamaConfig(**shapes)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 where it runs: no fp32 copy of the experts
    try:
        with torch.device("cuda"):
            model = (MixtralForCausalLM if mixtral else LlamaForCausalLM)(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():  # experts are created empty; random weights of a trained model's scale
        for name, param in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                param.normal_(std=0.02)
    return model


def gpu_ms(fn, ids, label: str, calls: int = 10) -> float:
    """Milliseconds of GPU kernel time per call, from the profiler: what the latency would be with no CPU cost.
    With --top-kernels, the kernels that take it are printed."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(ids, use_cache=False)
        torch.cuda.synchronize()
    if "--top-kernels" in sys.argv:
        print(f"{label}, {calls} calls:")
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=70))
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls / 1e3


def main():
    print(header())
    model = build("--mixtral" in sys.argv)
    print("model:", type(model).__name__)
    mode = "reduce-overhead" if "--reduce-overhead" in sys.argv else None
    recipes = [a for a in sys.argv[1:] if not a.startswith("--")] or ["fp8_block", "fp8_row", "int4_wo"]
    print("mode:", mode or "default")
    paths = {"eager": model, "inductor bf16": None, "torchao fp8 row": "torchao",
             **{f"fxquant {r}": r for r in recipes}}
    if "--no-torchao" in sys.argv:  # its first compile takes minutes
        del paths["torchao fp8 row"]
    inputs = {name: torch.randint(0, 32000, shape, device="cuda") for name, shape in SHAPES.items()}
    rows = []
    with torch.no_grad():
        reference = {name: model(ids, use_cache=False).logits.float() for name, ids in inputs.items()}
        for path, recipe in paths.items():
            torch._dynamo.reset()
            if path == "eager":
                fn = model
            elif recipe is None:
                fn = torch.compile(model, mode=mode)
            elif recipe == "torchao":
                quantized = peers.torchao_quantized(model, "fp8_row")
                if quantized is None:
                    continue
                fn = torch.compile(quantized, mode=mode)
            else:
                fn = torch.compile(model, backend="fxquant", options={"recipe": recipe, "mode": mode})
            for name, ids in inputs.items():
                start = time.perf_counter()
                logits = fn(ids, use_cache=False).logits.float()
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                ms = triton.testing.do_bench(lambda fn=fn, ids=ids: fn(ids, use_cache=False), warmup=25, rep=200,
                                             return_mode="median")
                kernels = gpu_ms(fn, ids, f"{path}, {name}")
                ref = reference[name]
                err = float((logits - ref).norm() / ref.norm())
                rows.append({"path": path, "shape": name, "ms": f"{ms:.2f}", "GPU kernel ms": f"{kernels:.2f}",
                             "first call s": f"{first:.1f}",
                             "logits rel err": f"{err:.4f}"})
                print(rows[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
