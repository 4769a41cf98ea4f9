"""`save_quantized` / `load_quantized`: a quantize_'d model as a compressed-tensors checkpoint (safetensors files plus
`quantization_config` in config.json), the format llm-compressor writes and vLLM and SGLang load."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from fxquant.compressed_tensors import SCHEMES, from_checkpoint, group_config, recipe_of, to_checkpoint
from fxquant.inplace import linear_weight
from fxquant.quantized_experts import QuantizedExperts
from fxquant.quantized_linear import QuantizedLinear

SHARD_BYTES = 5 * 2**30  # the file size transformers shards at by default
INDEX = "model.safetensors.index.json"


def save_quantized(model: nn.Module, path) -> None:
    """Write `model` (quantized by quantize_) to the folder `path`: its QuantizedLinear layers in their
    compressed-tensors layout, every other parameter and persistent buffer as it is (a tied weight once), and
    config.json with the model's config (a transformers model's) and `quantization_config`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors, seen, groups, ignore = {}, set(), defaultdict(list), []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantizedExperts):
            raise ValueError(f"fxquant: {name} holds quantized experts, and compressed-tensors checkpoints store "
                             "experts as per-expert linears (experts.0.w1, ...), a layout save_quantized does not "
                             "write yet. Fix: quantize_ with skip=[r'experts\\.'] to keep the experts in high "
                             "precision for the checkpoint, or save model.state_dict() for fxquant's own reload")
        if isinstance(module, QuantizedLinear):
            if module.recipe not in SCHEMES:
                raise ValueError(f"fxquant: {name} is quantized with {module.recipe}, which has no compressed-tensors "
                                 f"scheme here; save_quantized writes {', '.join(SCHEMES)}")
            groups[module.recipe].append(name)
            tensors.update({prefix + key: t.contiguous() for key, t in to_checkpoint(module, module.recipe).items()})
            if module.bias is not None:
                tensors[prefix + "bias"] = module.bias.detach().contiguous()
            continue
        if linear_weight(module) is not None:
            ignore.append(name)
        persistent = [n for n, _ in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
        for key, t in [*module.named_parameters(recurse=False), *((n, getattr(module, n)) for n in persistent)]:
            if t is not None and id(t) not in seen:  # a tied weight is stored under its first name
                seen.add(id(t))
                tensors[prefix + key] = t.detach().contiguous()
    _write_shards(tensors, path)
    config = model.config.to_dict() if hasattr(model, "config") and hasattr(model.config, "to_dict") else {}
    formats = {SCHEMES[recipe][0] for recipe in groups}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": group_config(recipe, names)
                          for i, (recipe, names) in enumerate(groups.items())},
        "ignore": ignore,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))


def _write_shards(tensors: dict[str, torch.Tensor], path: Path) -> None:
    shards, size = [{}], 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _matches(name: str, module: nn.Module, target: str) -> bool:
    """compressed-tensors' targets: "re:<regex>" on the name, the exact name, or a class name in the module's MRO."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name or any(cls.__name__ == target for cls in type(module).__mro__)


def _recipes(model: nn.Module, quantization_config: dict) -> dict[str, str]:
    """Layer name -> recipe, for every linear layer a config group targets and `ignore` does not."""
    ignore = quantization_config.get("ignore") or []
    found = {}
    for group_name, group in (quantization_config.get("config_groups") or {}).items():
        recipe = None
        for name, module in model.named_modules():
            if linear_weight(module) is None and not isinstance(module, QuantizedLinear):
                continue
            targets = group.get("targets") or []
            if any(_matches(name, module, t) for t in targets) and not any(_matches(name, module, t) for t in ignore):
                recipe = recipe or recipe_of(group, f"config group {group_name}")
                found[name] = recipe
    return found


def load_quantized(model: nn.Module, path, device=None) -> nn.Module:
    """Fill `model`, a skeleton (built on the meta device, or anywhere), from the compressed-tensors checkpoint in
    the folder `path`, in place: each quantized linear becomes a QuantizedLinear whose codes and scales are read
    straight from safetensors onto `device` (default: the CPU); no high-precision copy of a quantized weight is ever
    made. Every other parameter and persistent buffer is read as stored; tied parameters stay tied. Returns the
    model."""
    path, device = Path(path), torch.device(device or "cpu")
    config = json.loads((path / "config.json").read_text()).get("quantization_config")
    if not config or config.get("quant_method") != "compressed-tensors":
        raise ValueError(f"fxquant: {path / 'config.json'} holds no compressed-tensors quantization_config")
    recipes = _recipes(model, config)
    for name, recipe in recipes.items():
        module = model.get_submodule(name)
        if isinstance(module, QuantizedLinear):
            continue
        weight = linear_weight(module)
        skeleton = QuantizedLinear.empty(weight.shape[1], weight.shape[0], recipe, bias=module.bias is not None,
                                         dtype=weight.dtype, device="meta")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, skeleton)
    owners = defaultdict(list)  # id(tensor) -> every (module, attribute) holding it: ties are kept
    for module in model.modules():
        for key, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                owners[id(t)].append((module, key))
    pending = defaultdict(dict)  # quantized layer -> its checkpoint tensors, converted once all have arrived
    for file in _files(path):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118  (safe_open handles have keys(), not iteration)
                name, _, local = key.rpartition(".")
                if name in recipes and local != "bias":
                    pending[name][local] = f.get_tensor(key)
                    continue
                _assign(model, key, f.get_tensor(key), owners)
    for name, tensors in pending.items():
        module = model.get_submodule(name)
        for key, t in from_checkpoint(tensors, recipes[name], module.out_features).items():
            setattr(module, key, nn.Parameter(t, requires_grad=False))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"fxquant: the checkpoint in {path} holds no values for {left[:8]}"
                         f"{' and more' if len(left) > 8 else ''}, still on the meta device. Fix: build those "
                         "modules (non-persistent buffers such as rotary frequencies) on the target device")
    return model


def _files(path: Path) -> list[Path]:
    if (path / INDEX).exists():
        return sorted({path / f for f in json.loads((path / INDEX).read_text())["weight_map"].values()})
    return [path / "model.safetensors"]


def _assign(model: nn.Module, key: str, tensor: torch.Tensor, owners) -> None:
    """Put a checkpoint tensor in place of the model's `key`, and of every attribute tied to it."""
    name, _, attr = key.rpartition(".")
    module = model.get_submodule(name)
    current = module._parameters.get(attr, module._buffers.get(attr))
    if current is None and attr not in module._parameters and attr not in module._buffers:
        raise KeyError(f"fxquant: checkpoint tensor {key} has no place in the model")
    is_param = attr in module._parameters
    value = nn.Parameter(tensor, requires_grad=current.requires_grad) if is_param else tensor
    for owner, owner_attr in owners.get(id(current), [(module, attr)]):
        (owner._parameters if is_param else owner._buffers)[owner_attr] = value
