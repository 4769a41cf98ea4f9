"""`fxquant.export`: a torch.export program of the quantized graph, that saves, loads and runs; `fxquant.package`:
that program compiled by AOTInductor into a package that runs where fxquant is not installed."""

from __future__ import annotations

import torch

from fxquant.compile.pipeline import run_pipeline
from fxquant.config import QuantConfig, from_options
from fxquant.kernels.launch import kernels_inlined


def export(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, config: QuantConfig | dict | None = None,
           dynamic_shapes=None) -> torch.export.ExportedProgram:
    """Export `model`, quantize the exported graph per `config`, and export the result again.

    The program holds fxquant ops and the quantized weights (not a high-precision copy of them); load it
    in a process that has imported fxquant, so the ops are registered.
    """
    config = from_options(config)
    gm = torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes).module()
    # The exported module's placeholders are the flattened user inputs: the lint and recipe="auto" run on them.
    inputs = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    result = run_pipeline(gm, config, inputs)
    result.warn()
    _drop_unused_attributes(result.gm)
    return torch.export.export(result.gm, args, kwargs, dynamic_shapes=dynamic_shapes)


def package(program: torch.export.ExportedProgram, path: str, inductor_configs: dict | None = None) -> str:
    """AOTInductor's package of a program `fxquant.export` made, written to `path` (a `.pt2`); returns the path.

    The package holds no fxquant op: AOTInductor traces into each one, its torch ops and its Triton kernels (compiled
    into the package), so that `torch._inductor.aoti_load_package(path)` runs it in a process that never imports
    fxquant, and AOTInductor's C++ runtime runs it without Python. On the CPU the ops' pure-torch references are
    compiled into C++, and the package's outputs equal the program's bit for bit. inductor_configs: Inductor's
    options for the compile (over emulate_precision_casts=True)."""
    # Inductor rounds to bf16 where the program does: a fused kernel that kept fp32 between ops fed the quantizers
    # other values, and flipped codes put a 2-layer Llama's logits 4.2% from the program's, 0.055 rad from the exact
    # fake-quantized copy's, over the bound of 0.0325; bit for bit with it
    # (docs/decisions/0015-package-emulates-precision-casts.md)
    configs = {"emulate_precision_casts": True, **(inductor_configs or {})}
    with kernels_inlined():
        return torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)


def load(path, **kwargs) -> torch.export.ExportedProgram:
    """`torch.export.load` of a program `fxquant.export` saved: importing this module registers the fxquant ops
    the program calls, without which torch cannot deserialize it."""
    return torch.export.load(path, **kwargs)


def _drop_unused_attributes(gm: torch.fx.GraphModule) -> None:
    """Remove parameters and buffers no get_attr reads any more (the original weights of quantized layers)."""
    used = {node.target for node in gm.graph.nodes if node.op == "get_attr"}
    for name, _ in list(gm.named_parameters()) + list(gm.named_buffers()):
        if name in used:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        delattr(owner, attr)
