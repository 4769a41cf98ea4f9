"""Tensor-parallel runs: `world` processes, each building the same small model from a config, sharding it with
DTensor's parallel styles, and compiling it under backend="fxquant". The parent gets each rank's result (its
tensors on the CPU), or the rank's traceback as an error.

DEVICE: "cpu" (the default, as CI runs it) over gloo; with FXQUANT_TP_DEVICE=cuda, one GPU per rank over NCCL,
the model, its inputs and the device mesh on the rank's GPU."""

import contextlib
import io
import os
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hf_models import compiled_results, decoder, static_decode, traced

TIMEOUT_S = 600
DEVICE = os.environ.get("FXQUANT_TP_DEVICE", "cpu")
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def plan(model, experts: bool) -> dict:
    """q/k/v and gate/up column parallel, o and down row parallel, as transformers' Llama tp_plan; experts=True
    leaves the MLP whole on each rank (an MoE model's experts)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {}
    for name, _ in model.named_modules():
        if name.endswith(COLUMN) and not (experts and ".mlp." in name):
            styles[name] = ColwiseParallel()
        elif name.endswith(ROW) and not (experts and ".mlp." in name):
            styles[name] = RowwiseParallel()
    return styles


def mesh():
    """The 1-D device mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(DEVICE, (dist.get_world_size(),))


def on_device(model, *tensors):
    """The model and tensors on this rank's device."""
    return (model.to(DEVICE), *(t.to(DEVICE) for t in tensors))


def sharded_decode(arch: str, recipes, prompt, steps, experts=False, **overrides) -> dict:
    """On each rank: the sharded model's static-cache decode logits, eager and run by dynamo alone (traced), then per
    recipe the compiled model's logits and its layer records (name, recipe, reason, bytes before and after); recipe
    None compiles with nothing quantized."""
    from torch.distributed.tensor.parallel import parallelize_module

    model, prompt, steps = on_device(decoder(arch, **overrides), prompt, steps)
    parallelize_module(model, mesh(), plan(model, experts))
    results = {"eager": static_decode(model, model, prompt, steps),
               "traced": static_decode(model, traced(model), prompt, steps)}
    for recipe in recipes:
        options = {"recipe": recipe} if recipe else {"include": []}
        forward, compiled = compiled_results(model, {**options, "inner": "eager"})
        logits = static_decode(model, forward, prompt, steps)
        layers = {r.fqn: (r.recipe, r.reason, r.bytes_before, r.bytes_after) for result in compiled
                  for r in result.layers}
        results[recipe] = (logits, layers)
    return results


def sharded_quantize_(arch: str, recipe: str, prompt, steps, **overrides) -> dict:
    """On each rank: quantize_ on the sharded model; each sharded layer's class, the placements and local bytes of
    its parts, the report quantize_ printed, and the static-cache decode logits before, after (eager) and compiled
    under backend="fxquant"."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import fxquant

    model, prompt, steps = on_device(decoder(arch, **overrides), prompt, steps)
    parallelize_module(model, mesh(), plan(model, False))
    before = static_decode(model, model, prompt, steps)
    report = io.StringIO()
    with torch.no_grad(), contextlib.redirect_stdout(report):
        fxquant.quantize_(model, {"recipe": recipe, "report": True})
    sharded = {name: m for name, m in model.named_modules() if name.endswith(COLUMN + ROW)}
    parts = {name: {p: (tuple(t.placements), t.to_local().numel() * t.element_size())
                    for p, t in m.named_parameters() if isinstance(t, DTensor) and p != "bias"}
             for name, m in sharded.items()}
    after = static_decode(model, model, prompt, steps)
    torch._dynamo.reset()
    compiled = static_decode(model, torch.compile(model, backend="fxquant", options={"inner": "eager"}), prompt, steps)
    return {"classes": {name: type(m).__name__ for name, m in sharded.items()}, "parts": parts,
            "report": report.getvalue(), "before": before, "after": after, "compiled": compiled}


def sharded_save(arch: str, recipe: str, path: str, **overrides) -> str | None:
    """On each rank: quantize_ the sharded model and save_quantized it to `path` (rank 0 writes); the error's text
    where save_quantized refuses."""
    from torch.distributed.tensor.parallel import parallelize_module

    import fxquant

    model = on_device(decoder(arch, **overrides))[0]
    parallelize_module(model, mesh(), plan(model, False))
    fxquant.quantize_(model, recipe)
    try:
        fxquant.save_quantized(model, path)
    except ValueError as error:
        return str(error)
    return None


def sharded_load(checkpoints: dict, prompt, steps, **overrides) -> dict:
    """On each rank, per label of checkpoints {label: (architecture, folder)}: a skeleton built under empty_weights()
    and sharded, then load_quantized from the folder; the checkpoint keys read whole rather than sliced, each
    sharded layer's local parameters (codes, scales, bias) with their placements, the static-cache decode logits
    (eager: the loaded layers are the QuantizedLinear quantize_ gives a shard, whose compiled decode
    sharded_quantize_ checks), and save_quantized of the loaded model to `<folder>-resaved` (rank 0 writes). The
    error's text where loading refuses."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    import fxquant
    from fxquant.io import checkpoint

    read_whole = []

    class Reads:
        """A safetensors handle that records the keys read whole."""

        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_slice(self, key):
            return self.handle.get_slice(key)

        def get_tensor(self, key):
            read_whole.append(key)
            return self.handle.get_tensor(key)

    opened, checkpoint._opened = checkpoint._opened, lambda file, device: Reads(opened(file, device))
    results, prompt, steps = {}, prompt.to(DEVICE), steps.to(DEVICE)
    for label, (arch, folder) in checkpoints.items():
        read_whole.clear()
        built = decoder(arch, **overrides)  # its class and config
        with torch.device(DEVICE), fxquant.empty_weights():  # the buffers no checkpoint holds, on the device
            model = type(built)(built.config)
        model.to(torch.bfloat16)  # the rotary frequencies as the saved model held them
        parallelize_module(model, mesh(), plan(model, False))
        try:
            fxquant.load_quantized(model, folder, device=DEVICE)
        except ValueError as error:
            results[label] = str(error)
            continue
        parts = {name: {p: (tuple(t.placements), t.to_local()) for p, t in m.named_parameters()
                        if isinstance(t, DTensor)}
                 for name, m in model.named_modules() if name.endswith(COLUMN + ROW)}
        eager = static_decode(model, model, prompt, steps)
        fxquant.save_quantized(model, f"{folder}-resaved")
        results[label] = {"read_whole": list(read_whole), "parts": parts, "eager": eager}
    return results


def _worker(rank: int, world: int, port: int, task, kwargs: dict, results) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if DEVICE == "cuda":
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)  # the ranks share CI's two cores
        payload = io.BytesIO()  # tensors as bytes: shared memory would be gone once this process exits
        torch.save(task(**kwargs), payload)
        results.put((rank, payload.getvalue()))
    except Exception:
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(world: int, task, **kwargs) -> list:
    """task(**kwargs) on `world` spawned ranks; their results in rank order. A rank that raised fails the run with
    its traceback."""
    if DEVICE == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"{world} ranks need {world} GPUs, this machine has {torch.cuda.device_count()}")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_worker, args=(rank, world, port, task, kwargs, results)) for rank in range(world)]
    for process in ranks:
        process.start()
    got, deadline = {}, time.monotonic() + TIMEOUT_S
    while len(got) < world:
        try:
            rank, value = results.get(timeout=1)
            got[rank] = value
        except queue.Empty:
            # A rank killed (or crashed in the interpreter) before it put its result would leave the run waiting
            # for the whole timeout: name it at once.
            dead = {rank: p.exitcode for rank, p in enumerate(ranks) if rank not in got and p.exitcode not in (None, 0)}
            assert not dead and time.monotonic() < deadline, (
                f"ranks {sorted(dead)} ended with exit codes {list(dead.values())} and no result" if dead
                else f"no result from ranks {sorted(set(range(world)) - set(got))} within {TIMEOUT_S} s")
    for process in ranks:
        process.join(timeout=60)
    failed = [f"rank {rank}:\n{value}" for rank, value in got.items() if isinstance(value, str)]
    assert not failed, "\n".join(failed)
    return [torch.load(io.BytesIO(got[rank]), weights_only=False, map_location="cpu") for rank in range(world)]

