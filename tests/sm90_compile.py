"""Every launch made under Triton's interpreter, compiled for sm_90 as the GPU would compile it.

The interpreter runs a kernel's Python, not its compile: a kernel that only the compiler refuses (a variable whose
type changes inside an `if`, a layout the backend cannot convert) passes every CPU test and fails on the GPU.
`recorded_launches` notes each launch's kernel, argument types and constexprs while the interpreter runs it;
`compile_errors` compiles each distinct one with Triton's sm_90 backend, which needs no GPU, in a process without
the interpreter. The constexprs the interpreter chooses differently from the GPU are given the GPU's values
(`_gpu_value`), so the compile sees the code that the GPU runs.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import mangle_type

from fxquant.kernels.cast import CAST_EMULATED, CAST_NATIVE

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ("num_warps", "num_stages", "maxnreg")  # launch keywords that are compile options, not arguments


def _gpu_value(name: str, value, kernel: str, constexprs: dict):
    """A constexpr as the GPU's launcher sets it where the interpreter's differs: the casts in hardware, dependent
    launch on (sm_90), and the tensor-core operand type rather than the interpreter's fp32 (fp16 for e4m3 codes and
    the W4A8 kernels, whose codes are exact in it; bf16 otherwise)."""
    if name == "CAST" and value == CAST_EMULATED:
        return CAST_NATIVE
    if name == "PDL":
        return True
    if name == "DOT" and value == "fp32":
        return "fp16" if constexprs.get("KV_CODES") or "int4_fp8" in kernel or "e4m3" in kernel else "bf16"
    return value


def _encoded(value):
    """A constexpr as JSON: Triton dtypes by name."""
    value = value.value if isinstance(value, tl.constexpr) else value
    return {"dtype": str(value)} if isinstance(value, tl.dtype) else value


def _divisible(value) -> bool:
    """Whether the GPU's launcher specializes an argument as divisible by 16: a pointer by its address, an integer
    by its value."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _launch(fn: InterpretedFunction, args: tuple, kwargs: dict) -> dict:
    """One launch as the compile needs it: the kernel's module and name, each argument's type, the arguments
    divisible by 16 (pointers by address, integers by value, as the GPU's launcher specializes them), the
    constexprs with the GPU's values, and the compile options."""
    params = inspect.signature(fn.fn).parameters
    options = {key: kwargs[key] for key in OPTIONS if key in kwargs}
    bound = inspect.signature(fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    kernel = f"{fn.fn.__module__}.{fn.fn.__name__}"
    constexprs, signature, divisible = {}, {}, []
    for name, value in bound.arguments.items():
        annotation = params[name].annotation
        if value is None or "constexpr" in str(annotation):
            constexprs[name] = _encoded(value)
            signature[name] = "constexpr"
            continue
        signature[name] = mangle_type(value)
        if _divisible(value):
            divisible.append(name)
    plain = {name: (value["dtype"] if isinstance(value, dict) else value) for name, value in constexprs.items()}
    for name, value in constexprs.items():
        gpu = _gpu_value(name, plain[name], kernel, plain)
        if gpu != plain[name]:
            constexprs[name] = {"dtype": gpu} if isinstance(value, dict) else gpu
    return dict(kernel=kernel, signature=signature, constexprs=constexprs, divisible=divisible, options=options)


@contextlib.contextmanager
def recorded_launches():
    """Inside the block, every kernel launched under the interpreter runs as before and is appended to the list the
    block is given, once per distinct compile."""
    launches: list[dict] = []
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launch = _launch(self, args, kwargs)
        if launch not in launches:
            launches.append(launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with mock.patch.object(InterpretedFunction, "run", recording):
        yield launches


COMPILE = """
import importlib, json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

errors = {}
for launch in json.loads(sys.stdin.read()):
    module, name = launch["kernel"].rsplit(".", 1)
    kernel = getattr(importlib.import_module(module), name)
    params = list(launch["signature"])
    constexprs = {key: tl.dtype(value["dtype"]) if isinstance(value, dict) else value
                  for key, value in launch["constexprs"].items()}
    attrs = {(params.index(key),): [["tt.divisibility", 16]] for key in launch["divisible"]}
    try:
        triton.compile(ASTSource(fn=kernel, signature=launch["signature"], constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as error:  # every refusal is reported, with its kernel's constexprs
        errors.setdefault(launch["kernel"], []).append(f"{launch['constexprs']}: {error}"[-3000:])
print(json.dumps(errors))
"""


def compile_errors(launches: list[dict], timeout: int = 900) -> dict[str, list[str]]:
    """Each launch compiled for sm_90 in a process without the interpreter: {kernel: [its errors]}, empty where
    every one compiled."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(launches), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])
