"""Peer quantizers measured beside fxquant in the same process: torchao (carried to the device as a wheel) and
gemlite (its source folder on PYTHONPATH). Each quantizes a copy of the model's linear layers, the lm_head left in
bf16 as fxquant leaves it; each returns None, saying why, where the package does not import."""

from __future__ import annotations

import copy
import glob
import os
import sys

import torch

PATHS = ("torchao:fp8_row", "torchao:int4_wo", "gemlite:int4", "gemlite:fp8")
# The folder of one run's gemlite configs, a file per process that tuned them; the run makes it and its workers
# inherit it. Unset, configs are neither saved nor loaded: a stale folder would serve another version's kernels.
GEMLITE_TUNED = "FXQUANT_BENCH_GEMLITE_TUNED"


def _not_lm_head(module: torch.nn.Module, name: str) -> bool:
    return isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")


def torchao_quantized(model: torch.nn.Module, scheme: str) -> torch.nn.Module | None:
    """torchao's fp8 dynamic per-row activations and weights, or int4 weight-only g128 in tinygemm's layout (the
    packing that needs no fbgemm kernels)."""
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            Int4WeightOnlyConfig,
            PerRow,
            quantize_,
        )
    except Exception as exc:  # optional: carried to the device as a wheel
        print("torchao unavailable:", type(exc).__name__, str(exc)[:200])
        return None
    # set_inductor_config=False: torchao's default turns on Inductor's coordinate-descent tuning for the whole
    # process, which took minutes per compile and would tune every path run after it; all paths share one config.
    config = (Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
              if scheme == "fp8_row" else
              Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d", set_inductor_config=False))
    quantized = copy.deepcopy(model)
    quantize_(quantized, config, filter_fn=_not_lm_head)
    return quantized


def _gemlite_configs(gemlite) -> None:
    """gemlite ships tuned kernel configs per GPU name; a GPU it has none for (the H200) takes the H100's, the same
    sm_90 chip with less memory, rather than autotuning on the first call of each shape. Configs that this run's
    earlier processes tuned (save_gemlite_tuning) are loaded over them."""
    folder = os.path.join(os.path.dirname(gemlite.__file__), "configs")
    name = torch.cuda.get_device_properties(0).name.lower().replace(" ", "_")
    if not any(tag.split(".")[0] in name for tag in os.listdir(folder)):
        gemlite.load_config(os.path.join(folder, "h100.json"))
        print("gemlite: H100 kernel configs loaded for", name)
    for tuned in sorted(glob.glob(os.path.join(os.environ.get(GEMLITE_TUNED, ""), "*.json"))):
        gemlite.load_config(tuned)


def save_gemlite_tuning() -> None:
    """Where this process ran gemlite, the kernel configs it autotuned, to a file of its own in the run's GEMLITE_TUNED
    folder (gemlite locks its config file against threads only), for a later process to load. Triton's on-disk
    autotuning cache does not serve gemlite's kernels: with it on, gemlite int4 at batch 64 autotuned for 33 s again
    in a second process."""
    gemlite, folder = sys.modules.get("gemlite"), os.environ.get(GEMLITE_TUNED)
    if gemlite is not None and folder:
        gemlite.cache_config(os.path.join(folder, f"{os.getpid()}.json"))


def _int4_g128(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of 128 along K, gemlite's (code - zero) * scale convention."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // 128, 128)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-8)  # floor: a constant group keeps a finite scale
    zero = (-low / scale).round()
    codes = (groups / scale + zero).round().clamp(0, 15).to(torch.uint8).reshape(n, k)
    return codes, scale.reshape(n, k // 128), zero.reshape(n, k // 128)


def gemlite_quantized(model: torch.nn.Module, scheme: str) -> torch.nn.Module | None:
    """gemlite's A16W4 int4 g128 (weight-only) or A8W8 fp8 dynamic per-row layers in place of a copy's linears."""
    try:
        import gemlite
        from gemlite.helper import A16W4_HQQ_INT, A8W8_fp8_dynamic
    except Exception as exc:  # optional: its source folder on PYTHONPATH
        print("gemlite unavailable:", type(exc).__name__, str(exc)[:200])
        return None
    _gemlite_configs(gemlite)
    quantized = copy.deepcopy(model)
    for name, module in list(quantized.named_modules()):
        if not _not_lm_head(module, name):
            continue
        if scheme == "int4":
            codes, scale, zero = _int4_g128(module.weight.detach())
            layer = A16W4_HQQ_INT(device=module.weight.device, dtype=module.weight.dtype).from_weights(
                codes, scale, zero, bias=module.bias)
        else:
            layer = A8W8_fp8_dynamic(device=module.weight.device, dtype=module.weight.dtype).from_linear(module)
        parent, _, child = name.rpartition(".")
        setattr(quantized.get_submodule(parent), child, layer)
    return quantized


def quantized(model: torch.nn.Module, path: str) -> torch.nn.Module | None:
    """The model copy a peer path runs: 'torchao:fp8_row', 'torchao:int4_wo', 'gemlite:int4' or 'gemlite:fp8'."""
    library, scheme = path.split(":", 1)
    return torchao_quantized(model, scheme) if library == "torchao" else gemlite_quantized(model, scheme)
