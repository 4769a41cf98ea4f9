"""What the compute device can run: fp8 GEMMs need fp8 tensor cores, compute capability 8.9 (Ada) or newer."""

from __future__ import annotations

import torch

from fxquant.config import RECIPES, QuantConfig

FP8_MIN_CAPABILITY = (8, 9)
FP8_KINDS = ("fp8", "int4_fp8")  # the schemes whose GEMMs multiply on fp8 tensor cores
WEIGHT_ONLY = tuple(name for name, scheme in RECIPES.items() if scheme.kind == "weight_only")


def graph_device(gm: torch.nn.Module, example_inputs=()) -> torch.device:
    """The device the graph computes on: its first tensor input's, else its first parameter's or buffer's."""
    tensors = [t for t in example_inputs or () if isinstance(t, torch.Tensor)]
    tensors += list(gm.parameters()) + list(gm.buffers())
    return tensors[0].device if tensors else torch.device("cpu")


def fp8_gemm_supported(device: torch.device) -> bool:
    if device.type != "cuda":
        return True  # off CUDA the ops run the pure-torch reference
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def usable_recipes(device: torch.device) -> tuple[str, ...]:
    if fp8_gemm_supported(device):
        return tuple(RECIPES)
    return tuple(name for name, scheme in RECIPES.items() if scheme.kind not in FP8_KINDS)


def check_config(config: QuantConfig, device: torch.device) -> None:
    """Refuse, with the fix, a config whose fp8 GEMMs this device cannot run."""
    usable = usable_recipes(device)
    asked = {config.recipe, *(recipe for _, recipe in config.layer_recipes)} & set(RECIPES)
    refused = sorted(asked - set(usable))
    if refused:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(
            f"fxquant: recipe(s) {refused} run fp8 GEMMs, which need compute capability "
            f"{'.'.join(map(str, FP8_MIN_CAPABILITY))}+ (Ada, Hopper, Blackwell); {device} is {major}.{minor}. "
            f"Fix: use a weight-only recipe ({', '.join(WEIGHT_ONLY)}), or recipe='auto', which then picks among "
            "the recipes this device runs")
