"""Decode as users run it: a Llama built from a config, by default Llama-3-8B's shape (32 layers, hidden 4096,
intermediate 14336, 32 heads, 8 KV heads, vocab 128256, bf16, random weights; `--layers 8 --vocab 32000` is the
older 8-layer table's), prefills a prompt into a transformers StaticCache, then decodes one token per step with its
forward compiled per path (dynamic=False: one graph per shape, as a served model has).

Per path, in one process:
- check: the first decode steps' logits (teacher-forced, the same tokens as eager's) against eager bf16's;
  non-finite logits fail the path;
- decode: median ms per step over the steps after those, on the same static cache, the host's share of it (until
  the call returns), tokens/s, and the host ms inside CUDA graph replay() calls, unprofiled (graph replay ms);
- profile (--profile-batches, in a worker process of its own after the timed one, launching without programmatic
  dependent launch, whose waiting kernels would count their wait, unless --profile-pdl): GPU kernel ms per step, the
  step's span on the GPU and the idle time in it (`bench.timeline`), with the table of kernels and the largest gaps
  between them, and where the host's time goes, from the profiler's host ranges per step: dynamo's guards, the
  compiled region (dynamo's frame running the backend's callable), Inductor's compiled-graph call within it
  (CUDA-graph tree bookkeeping and the launch), and the graph launch itself; for fxquant, its wrapper's own per-call
  checks, timed alone (the graph it calls replaced by a no-op);
- prefill: median ms of a compiled prefill of the whole prompt into an emptied cache (batch 1 only);
- guards skipped (--skip-guards): the decode steps timed again with dynamo's guards skipped after the first steps;
- generate(): transformers' generate() with cache_implementation="static" and compile_config naming the path;
- fxquant.generate (--fxquant-generate-batches): the same prompt and --steps new tokens through fxquant.generate
  (fxquant paths under their recipe, inductor's with nothing quantized), its decode loop's tokens/s and host ms per
  step;
- peak GiB: the most GPU memory the path held, from its compile to its last step (model, cache, workspace).

The prefill that fills the cache before decoding runs eagerly, as generate() runs it: the cache's tensors are then
allocated outside dynamo and marked static, which CUDA graphs over a cache written in place require.

Run: python -m bench.decode [path ...] [--batches 1 16 64] [--prefill 1024] [--steps 32] [--mode reduce-overhead]
[--row-timeout 240] [--warm-jobs 8] [--skip-guards]
paths: inductor, fxquant:<recipe>, fxquant:<recipe>+fp8kv (the same over fxquant.FP8StaticCache),
fxquant:<recipe>+head=<recipe> (the lm_head quantized too, under the second recipe; +fp8kv may follow),
fxquant:<recipe>+without=<pass> (without one of the pipeline's optional passes; repeatable),
fxquant:<recipe>+inductor=<option> (one of Inductor's boolean options on, e.g. combo_kernels; =0 after it turns it
off, e.g. +inductor=triton.enable_pdl=0; repeatable),
fxquant:<recipe>+rows (int4 codes held in rows, not the GPU's default tiles: the option int4_code_tiles=False),
fxquant:<recipe>+tiles (int4 codes held in tiles wherever they tile, int4_fp8's too: int4_code_tiles=True),
fxquant:<recipe>+fp4inregisters (MXFP4 / NVFP4 GEMMs of one row in the in-register GEMM over rows: fp4_lanes=False),
fxquant:<recipe>+w4a8kernel (int4_fp8's GEMMs of one row on the W4A8 kernel, not the int4 mma.sync kernel:
int4_fp8_lanes=False),
fxquant:<recipe>+inplace (a copy of the model quantize_'d under the recipe, then compiled: a loaded checkpoint's path),
fxquant:<recipe>+nopdl (every fxquant kernel launched without programmatic dependent launch), +reducekernel (split
GEMMs summed by the reduce kernel, not by their last slice), +prefetch (the fp8 and 4-bit decode GEMMs ask the L2 for
their first weights before they wait for the previous kernel; by default the fp8 GEMM alone), +noprefetch (none
does), +mma8 (int4 GEMMs of up to 8 rows on the mma.sync kernel, not one), +tiles64 (the fp8 decode GEMMs of 9-16
rows in the tiles of 8 rows, as before decision 0035), +offsetafter (the int4 mma.sync GEMMs apply bf16 zero points
after the MMAs), +chunk=<n> (the weight-only prefill's weight dequantized 2**n
elements at a time, not CHUNK_ELEMENTS),
torchao:fp8_row, torchao:int4_wo, gemlite:int4, gemlite:fp8 (default: all but +fp8kv, +head, +without, +inductor,
+rows, +fp4inregisters, +w4a8kernel, +inplace and the launch settings).

Three phases. First, untimed, every path runs once in worker processes, --warm-jobs at a time, the longest first
(warm_groups): each compile and autotune fills the on-disk caches (Inductor's FX graph and AOT caches, Triton's
kernels, gemlite's tuned configs), and each row keeps its cold compile seconds; no more workers run at once than the
GPU's free memory holds. Then all paths are timed in one worker process, which finds their compiles in those caches,
as a restarted server does. Last, the --profile-batches rows are profiled in a worker of their own. A worker that
crashes or hangs is handled as bench/workers.py says; an item that crashed in the first phase is run again in the
timed phase, alone on the GPU, and one that hung is not run again.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from unittest.mock import patch

import torch
import transformers as T

import fxquant
from bench import peers, timeline, workers
from bench.common import LLAMA_3_VOCAB, header, llama, llama_config, table
from fxquant.compile.backend import fxquant as fxquant_backend
from fxquant.kernels import gemm_fp8, gemm_weight_only
from fxquant.kernels.dependent_launch import dependent_launches, weights_prefetched
from fxquant.kernels.gemm_int4_mma import MAX_M, serving_up_to, zero_points_after
from fxquant.kernels.splitk import reduce_in_gemm

CHECK_STEPS = 4  # the first decode steps: they compile, their logits are compared with eager's, and go untimed
PREFILL_REPEATS = 5


def cache_keyword(model) -> str:
    """transformers renamed past_key_values to cache; take whichever this version's forward has."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


class Decoder:
    """One path's model and compiled forward, over static caches of max_len tokens (prompt and decode steps)."""

    def __init__(self, model, forward, device: str, max_len: int, cache_class=T.StaticCache, callables=()):
        self.model, self.forward, self.device, self.max_len = model, forward, device, max_len
        self.keyword, self.caches, self.cache_class = cache_keyword(model), {}, cache_class
        self.callables = callables  # fxquant's compiled callables (QuantizedCallable), for wrapper_us

    def _call(self, forward, ids, cache, start: int):
        positions = torch.arange(start, start + ids.shape[1], device=self.device)
        return forward(input_ids=ids, cache_position=positions, use_cache=True, **{self.keyword: cache}).logits

    def prefilled(self, prompt):
        """The batch's cache, emptied, then holding the prompt, prefilled eagerly. One cache per batch size, made
        once: its tensors keep their static addresses, so CUDA graphs replay rather than record again."""
        batch = prompt.shape[0]
        if batch not in self.caches:
            self.caches[batch] = self.cache_class(config=self.model.config, max_cache_len=self.max_len)
        cache = self.caches[batch]
        cache.reset()
        self._call(self.model, prompt, cache, 0)
        return cache

    def steps(self, prompt, tokens, skip_guards: bool = False,
              replays: list[float] | None = None) -> tuple[torch.Tensor, list[float], list[float]]:
        """Last-position logits, and ms of each decode step (one per column of `tokens`, teacher-forced): until the
        call returns, which with the GPU idle at the start is the host's time before and while it launches the
        step, and until the step's GPU work has finished. skip_guards: the steps after the first CHECK_STEPS run
        under torch.compiler.set_stance(skip_guard_eval_unsafe=True), as README's "Fast decode" says. replays: gets
        each step's host ms inside CUDA graph replay() calls (`graph_replays`)."""
        cache, logits, returned, finished = self.prefilled(prompt), [], [], []
        for i in range(tokens.shape[1]):
            stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards and i >= CHECK_STEPS)
            sync(self.device)
            launches = []
            timing = graph_replays(launches) if replays is not None else contextlib.nullcontext()
            start = time.perf_counter()
            with stance, timing:
                out = self._call(self.forward, tokens[:, i:i + 1], cache, prompt.shape[1] + i)
            returned.append((time.perf_counter() - start) * 1e3)
            if replays is not None:
                replays.append(sum(launches))
            sync(self.device)
            finished.append((time.perf_counter() - start) * 1e3)
            logits.append(out[:, -1].float())
        return torch.stack(logits), returned, finished

    def profile(self, prompt, tokens, steps: int = 3) -> tuple[dict, str]:
        """Per decode step: GPU kernel ms, the number of kernels, the step's span on the GPU and the idle time in it
        (`bench.timeline`), and the host ms of dynamo's guard check and of the CUDA graph launch (both spent before
        the GPU starts a step); with the table of the kernels taking the GPU time and the largest gaps."""
        cache = self.prefilled(prompt)
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if self.device == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            for i in range(steps):
                self._call(self.forward, tokens[:, i:i + 1], cache, prompt.shape[1] + i)
            sync(self.device)
        events = prof.key_averages()
        host = {e.key: e.cpu_time_total for e in events}
        spans = lambda prefix: sum(t for key, t in host.items() if key.startswith(prefix)) / steps / 1e3
        # A device event that shares its name with a host range is that range's annotation on the GPU timeline
        # (Inductor's "## Call CompiledFxGraph"), spanning its kernels: counting it would count their time twice.
        ranges = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU}
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and e.name not in ranges]
        windows = [(e.time_range.start, e.time_range.end) for e in prof.events()  # each step's graph on the GPU
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("## Call CompiledFxGraph")]
        timelines = timeline.steps_timeline([timeline.Kernel(e.name, e.time_range.start, e.time_range.end)
                                             for e in kernels], windows, steps)
        idle = timeline.summary(timelines, steps) if timelines else {}
        numbers = {"GPU ms": f"{sum(e.device_time_total for e in kernels) / steps / 1e3:.3f}",
                   "kernels": f"{len(kernels) / steps:.0f}", **idle,
                   "guards ms": f"{spans('TorchDynamo Cache Lookup'):.3f}",
                   "compiled region ms": f"{spans('Torch-Compiled Region'):.3f}",
                   "Inductor call ms": f"{spans('## Call CompiledFxGraph'):.3f}",
                   "graph launch ms": f"{spans('cudaGraphLaunch'):.3f}"}
        if self.callables:
            numbers["fxquant wrapper us"] = f"{self.wrapper_us(prompt, tokens):.1f}"
        # 30 rows: every kind of kernel a decode layer launches (about 15), the small ones included
        kernel_table = events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)
        if timelines:
            kernel_table += "\nthe largest gaps between kernels (GPU idle):\n" + timeline.largest_gaps(timelines)
        return numbers, kernel_table

    def wrapper_us(self, prompt, tokens, calls: int = 200, repeats: int = 15) -> float:
        """Microseconds of host time per decode step in fxquant's QuantizedCallable itself (its checks of the
        frozen parameters and of the weights' versions, and the inputs it passes on): each callable a step calls
        is called again with that step's arguments and its compiled graph replaced by a no-op; the best of
        `repeats` runs of `calls` calls, summed over the callables."""
        cls, seen = type(self.callables[0]), {}
        call = cls.__call__

        def recording(callable_, *args):
            seen[id(callable_)] = (callable_, args)
            return call(callable_, *args)

        cls.__call__ = recording
        try:
            self._call(self.forward, tokens[:, :1], self.prefilled(prompt), prompt.shape[1])
        finally:
            cls.__call__ = call
        total = 0.0
        for callable_, args in seen.values():
            variant = callable_.variant
            compiled, variant.compiled = variant.compiled, lambda *inputs: None
            try:
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    for _ in range(calls):
                        callable_(*args)
                    best = min(best, (time.perf_counter() - start) / calls * 1e6)
            finally:
                variant.compiled = compiled
            total += best
        return total

    def prefill_ms(self, prompt) -> float:
        """Median ms of a compiled prefill of the prompt into a cache emptied before each (outside the timing)."""
        cache, times = self.prefilled(prompt), []
        for _ in range(PREFILL_REPEATS + 2):  # the first two compile and record
            cache.reset()
            sync(self.device)
            start = time.perf_counter()
            self._call(self.forward, prompt, cache, 0)
            sync(self.device)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[2:])


FP8_KV = "+fp8kv"
NO_PDL = "+nopdl"  # fxquant:<recipe>+nopdl: every kernel launched without programmatic dependent launch
REDUCE_KERNEL = "+reducekernel"  # split-K GEMMs summed by the reduce kernel, not by their last slice
PREFETCH = "+prefetch"  # every decode GEMM asks the L2 for its first weights before waiting on the previous kernel
NO_PREFETCH = "+noprefetch"  # none does (by default the fp8 GEMM does: decision 0030)
MMA_ROWS = "+mma8"  # int4 GEMMs of up to 8 rows on the mma.sync kernel (one row otherwise)
TILES_64 = "+tiles64"  # the fp8 decode GEMMs of 9-16 rows in the 64-wide tiles of 8 rows (before decision 0035)
OFFSET_AFTER = "+offsetafter"  # int4 mma.sync GEMMs apply bf16 zero points after the MMAs
LAUNCH_SETTINGS = (NO_PDL, REDUCE_KERNEL, PREFETCH, NO_PREFETCH, MMA_ROWS, TILES_64, OFFSET_AFTER)
CHUNK = "+chunk="  # +chunk=<n>: the weight-only prefill dequantizes its weight 2**n elements at a time


def chunk_elements(path: str) -> int | None:
    """The dequantized weight's chunk a path names with +chunk=<n> (2**n elements), else None (the product's)."""
    return next((2 ** int(extra.partition("=")[2]) for extra in path.split("+")[1:] if extra.startswith("chunk=")),
                None)


def prefetch_setting(path: str) -> bool | None:
    """`weights_prefetched`'s argument for a path: True under +prefetch, False under +noprefetch, else None (each
    kernel's default)."""
    extras = {"+" + extra for extra in path.split("+")[1:]}
    return True if PREFETCH in extras else False if NO_PREFETCH in extras else None


@contextlib.contextmanager
def launch_settings(path: str, profiled: bool = False):
    """The path's launch settings for the launches inside the block, graphs captured included. A profile launches
    without PDL: a kernel launched dependent is resident while it waits for the one before, and the profile would
    count the wait as its time."""
    with (dependent_launches(NO_PDL not in path and not profiled), reduce_in_gemm(REDUCE_KERNEL not in path),
          weights_prefetched(prefetch_setting(path)), serving_up_to(MAX_M if MMA_ROWS in path else 1),
          tiles_of_eight_rows(TILES_64 in path), dequantized_chunks(chunk_elements(path)),
          zero_points_after(OFFSET_AFTER in path)):
        yield


@contextlib.contextmanager
def dequantized_chunks(elements: int | None):
    """Inside the block (where given), the weight-only GEMMs past DEQUANTIZE_ABOVE_M rows dequantize their weight
    `elements` at a time (CHUNK_ELEMENTS), each chunk multiplied by cuBLAS."""
    if elements is None:
        yield
        return
    with patch.object(gemm_weight_only, "CHUNK_ELEMENTS", elements):
        yield


@contextlib.contextmanager
def tiles_of_eight_rows(enabled: bool):
    """Inside the block (where enabled), the fp8 GEMM plans 9-16 rows in the tiles it gives 8 (the decode tiles
    before docs/decisions/0035-decode-tiles-past-eight-rows.md); its cached plans are dropped on the way in and out."""
    if not enabled:
        yield
        return
    shipped = gemm_fp8.fp8_gemm_config
    gemm_fp8.fp8_gemm_config = lambda M, *args, **kwargs: shipped(8 if 8 < M <= 16 else M, *args, **kwargs)
    gemm_fp8._launch_plan.cache_clear()
    try:
        yield
    finally:
        gemm_fp8.fp8_gemm_config = shipped
        gemm_fp8._launch_plan.cache_clear()


@contextlib.contextmanager
def graph_replays(times: list[float]):
    """Appends the host ms of every CUDA graph replay() run inside the block: the graph launch timed without a
    profiler, whose cudaGraphLaunch range is mostly its own cost (BENCHMARKS.md, the host goal)."""
    replay = torch.cuda.CUDAGraph.replay

    def timed(graph):
        start = time.perf_counter()
        replay(graph)
        times.append((time.perf_counter() - start) * 1e3)

    torch.cuda.CUDAGraph.replay = timed
    try:
        yield times
    finally:
        torch.cuda.CUDAGraph.replay = replay


HEAD = "+head="  # fxquant:<recipe>+head=<recipe>: the lm_head quantized too, under its own recipe
WITHOUT = "+without="  # fxquant:<recipe>+without=<pass>: the pipeline without one of its optional passes
INDUCTOR = "+inductor="  # fxquant:<recipe>+inductor=<option>[=0]: one of Inductor's boolean options on (=0: off)
ROWS = "+rows"  # fxquant:<recipe>+rows: int4 codes held in rows (the backend's option int4_code_tiles=False)
TILES = "+tiles"  # int4 codes held in tiles wherever they tile, int4_fp8's too (int4_code_tiles=True)
IN_REGISTERS = "+fp4inregisters"  # MXFP4 / NVFP4 at M = 1 in the in-register GEMM over rows (fp4_lanes=False)
W4A8_KERNEL = "+w4a8kernel"  # int4_fp8's one-row GEMMs on the W4A8 kernel (int4_fp8_lanes=False)
IN_PLACE = "+inplace"  # fxquant:<recipe>+inplace: the model quantize_'d first (its copy), then compiled


def recipe_options(path: str) -> dict:
    """An fxquant path's backend options: its recipe; the lm_head's where the path names one (the lm_head stays in
    high precision by default); the passes it leaves out, to measure what a fusion is worth in the step;
    Inductor's options it turns on or off (+inductor=combo_kernels: Inductor's small kernels launched together;
    +inductor=triton.enable_pdl=0: Inductor's kernels launched without dependent launch)."""
    recipe, *extras = path.split(":", 1)[1].removesuffix(FP8_KV).split("+")
    options = {"recipe": recipe}
    for extra in extras:
        key, _, value = ("+" + extra).partition("=")
        if key + "=" == HEAD:
            options["layer_recipes"] = {r"(^|\.)lm_head$": value}
        elif key + "=" == WITHOUT:
            options.setdefault("disable_passes", []).append(value)
        elif key + "=" == INDUCTOR:
            option, _, flag = value.partition("=")
            options.setdefault("inductor", {})[option] = flag != "0"
        elif key == ROWS:
            options["int4_code_tiles"] = False
        elif key == TILES:
            options["int4_code_tiles"] = True
        elif key == IN_REGISTERS:
            options["fp4_lanes"] = False
        elif key == W4A8_KERNEL:
            options["int4_fp8_lanes"] = False
        elif key in LAUNCH_SETTINGS or key == IN_PLACE or key + "=" == CHUNK:
            continue  # a launch setting or the model's preparation, not a backend option: work() applies it
        else:
            raise ValueError(f"bench.decode: path {path!r}: {key!r} is none of +head=, +without=, +inductor=, "
                             f"+rows, +fp4inregisters, +w4a8kernel, +inplace, +fp8kv, +chunk=, "
                             f"{', '.join(LAUNCH_SETTINGS)}")
    return options


class Recording:
    """The fxquant backend, keeping each callable it returns."""

    def __init__(self):
        self.callables = []

    def __call__(self, gm, example_inputs, **kwargs):
        self.callables.append(fxquant_backend(gm, example_inputs, **kwargs))
        return self.callables[-1]


def compiled_forward(model, path: str, mode: str):
    """The path's model (a quantized copy for peers), its compiled forward (or the reason there is none), and the
    callables fxquant's backend returned, filled as it compiles."""
    if path == "inductor":
        return model, torch.compile(model.forward, mode=mode, dynamic=False), ()
    if path.startswith("fxquant:"):
        backend, options = Recording(), recipe_options(path)
        if IN_PLACE in path:  # the weights the model holds quantized, as a loaded checkpoint's: quantize_'s layers
            layers = {key: options[key] for key in ("recipe", "layer_recipes") if key in options}
            model = fxquant.quantize_(copy.deepcopy(model), layers, progress=False)
        return model, torch.compile(model.forward, backend=backend, dynamic=False,
                                    options={**options, "mode": mode}), backend.callables
    quantized = peers.quantized(model, path)
    if quantized is None:
        return None, f"{path.split(':')[0]} does not import here", ()
    return quantized, torch.compile(quantized.forward, mode=mode, dynamic=False), ()


def generate_rate(model, path: str, prompt, args) -> str:
    """Tokens/s of transformers' generate() with a static cache and the path as its compile_config."""
    if path.startswith("fxquant:"):  # torch.compile takes mode= or options=, not both: fxquant's options carry it
        config = T.CompileConfig(backend="fxquant", mode=None, dynamic=False,
                                 options={**recipe_options(path), "mode": args.mode})
    else:
        config = T.CompileConfig(backend="inductor", mode=args.mode, dynamic=False)
    cache = {"past_key_values": fxquant.FP8StaticCache(config=model.config, max_cache_len=prompt.shape[1] + args.steps)
             } if path.endswith(FP8_KV) else {"cache_implementation": "static"}
    kwargs = dict(max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False, compile_config=config,
                  **cache)
    model.generate(prompt, **kwargs)  # compiles
    if "past_key_values" in cache:  # generate() continues a cache it is given: empty it, or the prompt overruns it
        cache["past_key_values"].reset()
    sync(args.device)
    start = time.perf_counter()
    model.generate(prompt, **kwargs)
    sync(args.device)
    return f"{prompt.shape[0] * args.steps / (time.perf_counter() - start):.0f}"


def fxquant_generate_rate(model, path: str, prompt, args) -> dict:
    """fxquant.generate over the same model and prompt, args.steps new tokens, the second call timed (the first
    compiles and captures): tokens/s of the whole call (prefill included, as generate()'s column), tokens/s of its
    decode loop, and the host's ms per step in that loop (outside its waits for the GPU)."""
    from fxquant.generation import last_run, release

    options = recipe_options(path) if path.startswith("fxquant:") else {"include": []}
    cache = {"past_key_values": fxquant.FP8StaticCache(config=model.config, max_cache_len=prompt.shape[1] + args.steps)
             } if path.endswith(FP8_KV) else {}
    kwargs = dict(max_new_tokens=args.steps, do_sample=False, options=options, **cache)
    try:
        fxquant.generate(model, prompt, **kwargs)
        if cache:
            cache["past_key_values"].reset()
        sync(args.device)
        start = time.perf_counter()
        out = fxquant.generate(model, prompt, **kwargs)
        sync(args.device)
        whole, stats = time.perf_counter() - start, last_run(model)
        return {"fxquant.generate tokens/s": f"{out[:, prompt.shape[1]:].numel() / whole:.0f}",
                "its decode tokens/s": f"{prompt.shape[0] * stats.steps / stats.wall_s:.0f}",
                "its host ms/step": f"{stats.host_s / stats.steps * 1e3:.3f}",
                "its graph": "yes" if stats.graph else "no"}
    finally:
        release(model)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def work(items: list[tuple[str, int]], args):
    """The worker: every (path, batch) in order, paths compiled once, a row printed as each finishes."""
    workers.dump_stack_on_signal()
    model = llama(args.layers, args.hidden, args.device, args.vocab)
    generator = torch.Generator().manual_seed(1)
    inputs, eager, max_len = {}, {}, args.prefill + args.steps
    with torch.no_grad():
        for _, batch in items:
            if batch not in inputs:
                prompt = torch.randint(0, args.vocab, (batch, args.prefill), generator=generator).to(args.device)
                tokens = torch.randint(0, args.vocab, (batch, args.steps), generator=generator).to(args.device)
                inputs[batch] = prompt, tokens
                compared = not (args.warm or args.profile_only)
                eager[batch] = Decoder(model, model, args.device, max_len).steps(
                    prompt, tokens[:, :CHECK_STEPS])[0] if compared else None
        current = None
        for path, batch in items:
            with launch_settings(path, args.profile_only and not args.profile_pdl):
                if path != current:
                    current, decoder = path, None
                    torch._dynamo.reset()
                    gc.collect()
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    start = time.perf_counter()
                    runner, forward, callables = compiled_forward(model, path, args.mode)
                    quantize_s = time.perf_counter() - start
                    if runner is not None:
                        cache_class = fxquant.FP8StaticCache if path.endswith(FP8_KV) else T.StaticCache
                        decoder = Decoder(runner, forward, args.device, max_len, cache_class, callables)
                if decoder is None:
                    workers.print_row({"path": path, "batch": batch, "check": forward})
                    continue
                row = one(decoder, path, batch, inputs[batch], eager[batch], quantize_s, args)
                if args.warm:
                    peers.save_gemlite_tuning()
                workers.print_row(row)


def one(decoder: Decoder, path: str, batch: int, inputs, eager, quantize_s: float, args) -> dict:
    """The item's row. The first CHECK_STEPS steps compile and record, and their logits are checked against eager's
    (in the first phase, which has no eager logits, only for being finite); the steps after them are timed. A
    profile worker's row holds only the profile, taken after the steps that compile."""
    prompt, tokens = inputs
    if args.profile_only:
        decoder.steps(prompt, tokens[:, :CHECK_STEPS])  # compile and record first
        numbers, kernels = decoder.profile(prompt, tokens)
        print(f"{path}, batch {batch}, 3 decode steps:\n{kernels}", flush=True)
        return {"path": path, "batch": batch, "check": "profiled", **numbers}
    replays = []
    got, returned, finished = decoder.steps(prompt, tokens, replays=replays)
    got = got[:CHECK_STEPS]
    if not torch.isfinite(got).all():
        raise RuntimeError(f"{path}, batch {batch}: non-finite logits")
    check = "finite" if eager is None else f"min cos {min(cosine(g, e) for g, e in zip(got, eager, strict=True)):.4f}"
    row = {"path": path, "batch": batch, "check": check,
           "first steps s": f"{quantize_s + sum(finished[:CHECK_STEPS]) / 1e3:.1f}"}
    ms = statistics.median(finished[CHECK_STEPS:])
    row |= {"decode ms": f"{ms:.3f}", "host ms": f"{statistics.median(returned[CHECK_STEPS:]):.3f}",
            "tokens/s": f"{batch * 1e3 / ms:.0f}", "graph replay ms": f"{statistics.median(replays[CHECK_STEPS:]):.3f}"}
    if args.skip_guards:
        _, returned, finished = decoder.steps(prompt, tokens, skip_guards=True)
        row |= {"decode ms, guards skipped": f"{statistics.median(finished[CHECK_STEPS:]):.3f}",
                "host ms, guards skipped": f"{statistics.median(returned[CHECK_STEPS:]):.3f}"}
    if args.device == "cuda":
        row["peak GiB"] = f"{torch.cuda.max_memory_allocated() / 2**30:.1f}"
    start = time.perf_counter()
    row["prefill ms"] = f"{decoder.prefill_ms(prompt):.2f}" if batch in args.prefill_batches else "-"
    prefill_s, start = time.perf_counter() - start, time.perf_counter()
    row["generate() tokens/s"] = (generate_rate(decoder.model, path, prompt, args)
                                  if batch in args.generate_batches else "-")
    row["prefill, generate s"] = f"{prefill_s:.0f}, {time.perf_counter() - start:.0f}"  # wall time, compiles included
    if batch in args.fxquant_generate_batches and (path == "inductor" or path.startswith("fxquant:")):
        row |= fxquant_generate_rate(decoder.model, path, prompt, args)
    return row


def run_workers(items: list[tuple[str, int]], args, warm: bool = False, profile: bool = False) -> list[dict]:
    """The items' rows from worker processes of this module. A `warm` worker (the first phase) compares with no
    eager logits and is quiet. Only a `profile` worker profiles, and it times nothing: a step timed in a process
    after a profile ran took 0.19-0.21 ms in replay() where unprofiled processes took 0.02 (bench/HISTORY.md,
    "2026-12-02: the stored-order int4 kernel in the product")."""
    forwarded = ("layers", "hidden", "vocab", "prefill", "steps", "mode", "device", "row_timeout")
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in forwarded]
    passed += ["--skip-guards"] if args.skip_guards else []
    passed += ["--profile-pdl"] if args.profile_pdl else []
    for option in ("prefill_batches", "generate_batches", "fxquant_generate_batches"):
        passed += [f"--{option.replace('_', '-')}", *map(str, getattr(args, option))]
    passed += ["--warm"] if warm else ["--profile-only"] if profile else []
    return workers.run([sys.executable, "-m", "bench.decode", *passed], items, args.row_timeout, quiet=warm)


def worker_bytes(args) -> int:
    """A first-phase worker's GPU memory at the largest batch, by arithmetic: the bf16 weights twice (the backend
    keeps a quantized copy beside them, and a peer quantizes a deep copy), the static cache, and the eager prefill's
    logits over the whole prompt and vocabulary (bf16, and the fp32 copy of the last position's is small)."""
    config = llama_config(args.layers, args.hidden, args.vocab)
    with torch.device("meta"):
        weights = sum(p.numel() for p in T.LlamaForCausalLM(config).parameters()) * 2
    batch, tokens = max(args.batches), args.prefill + args.steps
    head_dim = config.hidden_size // config.num_attention_heads
    cache = 2 * config.num_hidden_layers * batch * tokens * config.num_key_value_heads * head_dim * 2
    logits = batch * args.prefill * config.vocab_size * 2
    return 2 * weights + cache + logits


def warm_jobs(asked: int, free_bytes: int, per_worker: int) -> int:
    """Workers at once in the first phase: as many as asked, but no more than the free GPU memory holds (nine
    tenths of it, for the CUDA contexts and the allocators' slack), and at least one. Four 32-layer workers at
    batch 16 and a 4k prompt ran out of memory on the H200 and lost their rows."""
    return max(1, min(asked, int(0.9 * free_bytes) // max(per_worker, 1)))


def warm_caches(items: list[tuple[str, int]], args) -> dict[tuple[str, int], dict]:
    """The untimed first phase: workers run their items once without profiling, as many at a time as args.warm_jobs
    and the GPU's free memory allow (warm_jobs). Returns each item's row, which holds its cold compile seconds or
    why it failed."""
    jobs = args.warm_jobs
    if args.device == "cuda":
        per_worker = worker_bytes(args)
        jobs = warm_jobs(args.warm_jobs, torch.cuda.mem_get_info()[0], per_worker)
        print(f"first phase: {jobs} worker(s) at once, each up to {per_worker / 2**30:.0f} GiB by arithmetic",
              flush=True)
    with ThreadPoolExecutor(jobs) as pool:
        done = pool.map(lambda group: run_workers(group, args, warm=True), warm_groups(items))
    return {(row["path"], row["batch"]): row for rows in done for row in rows}


def to_time(items: list[tuple[str, int]], cold: dict[tuple[str, int], dict]) -> list[tuple[str, int]]:
    """The items the timed phase runs: every one but those that hung in the first phase (they would hang again, for
    the whole row timeout). An item that crashed there (out of memory beside the other workers, say) runs again
    alone; if it fails again, its row says why."""
    return [item for item in items if not workers.hung(cold.get(item, {"check": ""}))]


def warm_groups(items: list[tuple[str, int]]) -> list[list[tuple[str, int]]]:
    """The first phase's workers, the longest first. A peer autotunes its kernels per shape on their first calls
    (gemlite's fp8 for 35-97 s a batch), so each of its batches gets a worker and they tune at once; a path compiled
    by Inductor alone runs its batches in one worker, which starts its process and builds its model once."""
    groups: dict = {}
    for path, batch in items:
        groups.setdefault((path, batch) if path in peers.PATHS else path, []).append((path, batch))
    return sorted(groups.values(), key=lambda group: (not group[0][0].startswith("gemlite"),
                                                       group[0][0] not in peers.PATHS))


def step_options(parser: argparse.ArgumentParser, batches: list[int], steps: int):
    """The options of a decode-step benchmark: the model's shape, the prompt, the steps timed, the compile mode and
    the device (shared with bench.decode_tp)."""
    parser.add_argument("--batches", type=int, nargs="+", default=batches)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=LLAMA_3_VOCAB)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--prefill", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--mode", default="reduce-overhead", choices=["default", "reduce-overhead"])
    parser.add_argument("--device", default="cuda")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="*", default=["inductor", *(f"fxquant:{r}" for r in fxquant.RECIPES),
                                                      *peers.PATHS])
    step_options(parser, batches=[1, 16, 64], steps=32)
    parser.add_argument("--prefill-batches", type=int, nargs="*", default=[1])
    parser.add_argument("--generate-batches", type=int, nargs="*", default=[1])
    parser.add_argument("--fxquant-generate-batches", type=int, nargs="*", default=[1],
                        help="batches whose row times fxquant.generate too (not for peers' paths)")
    parser.add_argument("--profile-batches", type=int, nargs="*", default=[1])
    parser.add_argument("--profile-pdl", action="store_true",
                        help="profile with programmatic dependent launch on, as the timed steps run: the span and "
                             "idle columns are then the step's; GPU ms counts a dependent kernel's wait as its time")
    parser.add_argument("--skip-guards", action="store_true",
                        help="time the decode steps again under set_stance(skip_guard_eval_unsafe=True)")
    parser.add_argument("--row-timeout", type=float, default=240,
                        help="seconds a path may take for one batch's row (compiles included) before it is failed")
    parser.add_argument("--warm-jobs", type=int, default=8,
                        help="workers compiling at once in the untimed first phase (0: no first phase)")
    parser.add_argument("--worker", help="internal: the JSON list of (path, batch) a worker runs")
    parser.add_argument("--warm", action="store_true", help="internal: the worker runs in the first phase")
    parser.add_argument("--profile-only", action="store_true", help="internal: the worker profiles, timing nothing")
    args = parser.parse_args()
    if args.steps <= CHECK_STEPS:
        parser.error(f"--steps {args.steps}: the first {CHECK_STEPS} steps compile and are checked, untimed; "
                     f"give more than {CHECK_STEPS}")
    if args.worker:
        work([tuple(item) for item in json.loads(args.worker)], args)
        return
    if args.device == "cuda":
        print(header())
    items, start = [(path, batch) for path in args.paths for batch in args.batches], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gemlite_tuned_") as tuned:
        os.environ[peers.GEMLITE_TUNED] = tuned  # this run's configs, for its workers
        cold = warm_caches(items, args) if args.warm_jobs else {}
        if cold:
            print(f"first phase, every compile cold: {time.perf_counter() - start:.0f} s", flush=True)
        timed = run_workers(to_time(items, cold), args)
        profiled = run_workers([(row["path"], row["batch"]) for row in timed if row["batch"] in args.profile_batches
                                and not workers.failed(row)], args, profile=True)
    by_item = {(row["path"], row["batch"]): row for row in timed}
    for row in profiled:  # the profile's columns join the timed row; a failed profile says so in its own column
        numbers = {"profile": row["check"]} if workers.failed(row) else row
        by_item[row["path"], row["batch"]] |= {k: v for k, v in numbers.items() if k not in ("path", "batch", "check")}
    rows = []
    for item in items:
        row = by_item.get(item) or cold[item]
        if item in cold and not workers.failed(cold[item]):
            row["cold first steps s"] = cold[item]["first steps s"]
        rows.append(row)
    print(f"whole run: {time.perf_counter() - start:.0f} s")
    print(table(rows))


if __name__ == "__main__":
    main()
