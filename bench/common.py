"""Timing helpers shared by the benchmarks: median of CUDA-event timings over rotating inputs."""

from __future__ import annotations

import itertools
import os
import platform
import subprocess
import sys
import tempfile

import torch
import transformers as T
import triton
import triton.testing

L2_FLUSH_BYTES = 256 * 2**20  # several times the H200's 60 MB L2: every timed call reads from HBM


def rotating(make_args, bytes_per_set: int) -> list:
    """Enough independent argument sets that cycling through them defeats the L2."""
    n = max(1, min(64, -(-L2_FLUSH_BYTES // max(bytes_per_set, 1))))
    return [make_args() for _ in range(n)]


def time_ms(fn, arg_sets: list) -> float:
    """Median milliseconds of fn(*args), cycling through arg_sets."""
    cycle = itertools.cycle(arg_sets)
    return triton.testing.do_bench(lambda: fn(*next(cycle)), warmup=25, rep=200, return_mode="median")


def graph_time_ms(fn, arg_sets: list) -> float:
    """Median milliseconds of fn(*args) replayed from a CUDA graph: GPU time without launch overhead."""
    cycle = itertools.cycle(arg_sets)
    return triton.testing.do_bench_cudagraph(lambda: fn(*next(cycle)), rep=100, return_mode="median")


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, bytes read + written: the memory ceiling measured in the same process."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def commit() -> str:
    """The code's commit: FXQUANT_COMMIT where set (a copied tree's .git may name an older commit than the code it
    holds), else git's, marked -dirty when the tree differs from it, with the id of the tree as it is: `git log
    --format='%h %T'` finds the commit whose tree that is."""
    if os.environ.get("FXQUANT_COMMIT"):
        return os.environ["FXQUANT_COMMIT"]
    try:
        described = _git("describe", "--always", "--dirty")
        if described.endswith("-dirty"):
            with tempfile.TemporaryDirectory() as scratch:  # an index of its own: git's own index is left alone
                index = {"GIT_INDEX_FILE": os.path.join(scratch, "index")}
                _git("add", "--all", env=index)  # every file git does not ignore, as a commit of it would hold
                described += f" (tree {_git('write-tree', env=index)})"
        return described
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _git(*args: str, env: dict | None = None) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                          env={**os.environ, **(env or {})}).stdout.strip()


LLAMA_3_VOCAB = 128256


def llama_config(layers: int, hidden: int = 4096, vocab: int = 32000):
    """The Llama shapes the benchmarks use: at hidden 4096, intermediate 14336, 32 heads, 8 KV heads; with 32 layers
    and vocab 128256, Llama-3-8B's."""
    return T.LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 7 // 2, num_attention_heads=hidden // 128,
                         num_key_value_heads=max(1, hidden // 512), num_hidden_layers=layers, vocab_size=vocab)


def llama(layers: int, hidden: int = 4096, device: str = "cuda", vocab: int = 32000):
    """A random-weight Llama built in bf16 where it runs: no fp32 copy is ever made."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return T.LlamaForCausalLM(llama_config(layers, hidden, vocab)).eval()
    finally:
        torch.set_default_dtype(default)


def values_after(flag: str, default) -> list[str]:
    """The arguments after `flag` up to the next flag, or `default` where it is not given."""
    if flag not in sys.argv:
        return list(default)
    rest = sys.argv[sys.argv.index(flag) + 1:]
    return rest[:next((i for i, v in enumerate(rest) if v.startswith("--")), len(rest))]


def rows_against_bf16(runs: dict, **key) -> list[dict]:
    """Each run's median us from CUDA-graph replay and its speed against runs["bf16"], as table rows led by `key`,
    each printed as it is timed."""
    times = {name: triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") for name, fn in runs.items()}
    rows = []
    for name, ms in times.items():
        rows.append({**key, "GEMM": name, "us": f"{ms * 1e3:.1f}", "x bf16": f"{times['bf16'] / ms:.2f}"})
        print(rows[-1], flush=True)
    return rows


def header() -> str:
    props = torch.cuda.get_device_properties(0)
    return (f"commit {commit()}; GPU {props.name} (sm_{props.major}{props.minor}, {props.multi_processor_count} SMs), "
            f"torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}")


def table(rows: list[dict]) -> str:
    """A markdown table of the rows' columns in first-seen order; a row without a column shows '-'."""
    cols = list(dict.fromkeys(c for r in rows for c in r))
    cells = [[str(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = lambda vals: "| " + " | ".join(v.rjust(w) for v, w in zip(vals, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cols), rule] + [line(row) for row in cells])
