"""`save_quantized` / `load_quantized`: a quantize_'d model as a compressed-tensors checkpoint (safetensors files plus
`quantization_config` in config.json), the format llm-compressor writes and vLLM and SGLang load."""

from __future__ import annotations

import functools
import json
import os
import re
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from fxquant.config import RECIPES
from fxquant.io import kv_cache_scheme
from fxquant.io.checkpoint_experts import expert_linear_names, split_experts, stack_experts
from fxquant.io.checkpoint_mxfp4 import MXFP4_METHOD, from_mxfp4, mxfp4_experts
from fxquant.io.compressed_tensors import from_checkpoint, group_config, recipe_of, scheme_of, to_checkpoint, writable
from fxquant.io.sharded_checkpoint import read_parameter, sharded_layer
from fxquant.modules.inplace import linear_weight, progress_hidden
from fxquant.modules.quantized_experts import QuantizedExperts, is_experts
from fxquant.modules.quantized_linear import QuantizedLinear
from fxquant.modules.sharded_linear import gathered, move_hooks, whole
from fxquant.modules.skeleton import skeleton_of

SHARD_BYTES = 5 * 2**30  # the file size transformers shards at by default
INDEX = "model.safetensors.index.json"
HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


def save_quantized(model: nn.Module, path, kv_scales: list[tuple[float, float]] | None = None) -> None:
    """Write `model` (quantized by quantize_) to the folder `path`: its QuantizedLinear layers in their
    compressed-tensors layout, its QuantizedExperts as the checkpoint's per-expert linears (`checkpoint_experts`),
    every other parameter and persistent buffer as it is (a tied weight once), and config.json with the model's
    config (a transformers model's) and `quantization_config`. kv_scales: static fp8 KV-cache scales, one (k, v)
    pair per attention layer (kv_scales_of), stored in compressed-tensors' kv_cache_scheme.

    A tensor-parallel model (DTensor parameters, quantize_'d shard by shard) is saved whole: every rank calls
    save_quantized, its shards are all-gathered, and rank 0 writes the checkpoint the unsharded model would
    (`sharded_linear.gathered`, which refuses by name a row-parallel per-channel scale that differs between
    shards)."""
    path = Path(path)
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    tensors, seen, groups, ignore = {}, set(), defaultdict(list), []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantizedExperts):  # as the checkpoint's per-expert linears
            if not writable(module.recipe):
                raise ValueError(f"fxquant: {name} is quantized with {module.recipe}, which has no compressed-tensors "
                                 f"scheme here; save_quantized writes {', '.join(filter(writable, RECIPES))}")
            for linear, part in split_experts(model, name, module).items():
                groups[module.recipe].append(linear)
                stored = to_checkpoint(part, module.recipe)
                tensors.update({f"{linear}.{key}": t.contiguous() for key, t in stored.items()})
            continue
        if isinstance(module, QuantizedLinear):
            if not writable(module.recipe):
                raise ValueError(f"fxquant: {name} is quantized with {module.recipe}, which has no compressed-tensors "
                                 f"scheme here; save_quantized writes {', '.join(filter(writable, RECIPES))}")
            module = gathered(module, name)
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
                tensors[prefix + key] = whole(t).detach().contiguous()
    if kv_scales is not None:
        tensors.update(kv_cache_scheme.scale_tensors(model, kv_scales))
    if not groups:
        raise ValueError(f"fxquant: {type(model).__name__} holds no layer quantize_ quantized (QuantizedLinear, "
                         "QuantizedExperts): its checkpoint would be a plain one labelled compressed-tensors. Fix: "
                         "fxquant.quantize_(model, config) first, or save it with save_pretrained or torch.save")
    if sharded and dist.get_rank() != 0:
        return  # every rank gathered the shards above; the first one writes
    path.mkdir(parents=True, exist_ok=True)
    _write_shards(tensors, path)
    config = model.config.to_dict() if hasattr(model, "config") and hasattr(model.config, "to_dict") else {}
    if _head_untied(model):
        for tied in (config, config.get("text_config") or {}):
            if tied.get("tie_word_embeddings"):
                tied["tie_word_embeddings"] = False
    if config:  # the model's class, as save_pretrained records it: vLLM and load_quantized(folder) build by it
        config["architectures"] = [type(model).__name__]
    floating = [t.dtype for key, t in tensors.items() if t.dtype in HIGH_PRECISION and "scale" not in key]
    if floating:  # the dtype the model ran in, for load_quantized(dtype="auto") and from_pretrained
        config["dtype"] = str(max(set(floating), key=floating.count)).removeprefix("torch.")
    formats = {scheme_of(recipe)[0] for recipe in groups}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": group_config(recipe, names)
                          for i, (recipe, names) in enumerate(groups.items())},
        "ignore": ignore,
        "kv_cache_scheme": kv_cache_scheme.SCHEME if kv_scales is not None else None,
    }
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))


def _head_untied(model: nn.Module) -> bool:
    """A transformers model whose LM head holds a weight of its own (quantized after it was untied), which its config
    may still call tied: saved tied, a loader would read the embedding for the head and drop the quantized one."""
    if not (hasattr(model, "get_output_embeddings") and hasattr(model, "get_input_embeddings")):
        return False
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and getattr(head, "weight", None) is not embedding.weight


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
        save_file(_owning(shards[0]), path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(_owning(shard), path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))


def _owning(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The shard with each tensor that is a view into a larger storage (an expert's rows of the stacked experts)
    copied, since safetensors refuses tensors that share memory; one shard's copies at a time."""
    whole = lambda t: t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return {key: t if whole(t) else t.clone() for key, t in shard.items()}


def _matches(name: str, module: nn.Module | None, target: str) -> bool:
    """compressed-tensors' targets: "re:<regex>" on the name, the exact name, or a class name in the module's MRO
    (a checkpoint's per-expert linear, which has no module here, is a Linear)."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    classes = [cls.__name__ for cls in type(module).__mro__] if module is not None else ["Linear"]
    return target == name or target in classes


def recipe_of_layer(name: str, module: nn.Module | None, quantization_config: dict) -> str | None:
    """The recipe of the config group that targets the layer `name` and `ignore` does not name, or None."""
    if any(_matches(name, module, t) for t in quantization_config.get("ignore") or []):
        return None
    for group_name, group in (quantization_config.get("config_groups") or {}).items():
        if any(_matches(name, module, t) for t in group.get("targets") or []):
            return recipe_of(group, f"config group {group_name}")
    return None


def _recipes(model: nn.Module, quantization_config: dict) -> dict[str, str]:
    """Layer name -> recipe, for every linear layer a config group targets and `ignore` does not."""
    found = {}
    for name, module in model.named_modules():
        if linear_weight(module) is not None or isinstance(module, QuantizedLinear):
            recipe = recipe_of_layer(name, module, quantization_config)
            if recipe is not None:
                found[name] = recipe
    return found


def _expert_recipes(model: nn.Module, quantization_config: dict) -> dict[str, tuple[str, dict[str, str]]]:
    """Experts module name -> (recipe, checkpoint linear name -> the module), for each experts module whose
    per-expert linears the config quantizes, all under one recipe (else a clear error)."""
    found = {}
    for name, module in model.named_modules():
        if not is_experts(module):
            continue
        linears = [n for names in expert_linear_names(model, name, module.gate_up_proj.shape[0]) for n in names]
        recipes = {recipe_of_layer(linear, None, quantization_config) for linear in linears}
        if recipes == {None}:
            continue
        if len(recipes) > 1:
            raise ValueError(f"fxquant: the checkpoint quantizes {name}'s per-expert linears under different schemes "
                             f"({', '.join(sorted(map(str, recipes)))}); fxquant's experts take one per module")
        found[name] = (recipes.pop(), dict.fromkeys(linears, name))
    return found


def load_quantized(model: nn.Module | str | os.PathLike, path=None, device=None, dtype: torch.dtype | str = "auto",
                   progress: bool | None = None) -> nn.Module:
    """Fill `model`, a skeleton (built on the meta device, or anywhere), from the compressed-tensors checkpoint in
    the folder `path`, in place; given the folder alone (`load_quantized(path, device=...)`), build the skeleton
    first, in eval mode: the transformers class its config.json names (`skeleton.skeleton_of`). Each quantized
    linear becomes a QuantizedLinear whose codes and scales are read straight from safetensors onto `device`
    (default: the CPU); no high-precision copy of a quantized weight is ever made. transformers' own MXFP4
    checkpoints (GPT-OSS's) load too, their experts as mxfp4_wo QuantizedExperts (`checkpoint_mxfp4`). Every other
    parameter and persistent buffer is read as stored; tied parameters stay tied. High-precision tensors take the
    checkpoint's dtype (dtype="auto": config.json's `dtype`, else the first floating tensor's, as transformers'
    from_pretrained does), whatever dtype the skeleton was built in; a dtype given casts them to it. Codes and scales
    keep their formats. Returns the model.

    A skeleton sharded with DTensor's parallel styles (after empty_weights(), before loading) is filled shard by
    shard: each rank reads only its slice of every sharded tensor, and a sharded quantized linear becomes the
    QuantizedLinear quantize_ gives that shard (`sharded_checkpoint`). `progress` shows a bar over the tensors read
    (None: on a terminal only)."""
    if not isinstance(model, nn.Module):
        if path is not None:
            raise TypeError(f"fxquant: load_quantized takes a skeleton and a folder, or a folder alone; got "
                            f"{model!r} and {path!r}. Fix: load_quantized(skeleton, path) or load_quantized(path)")
        model, path = None, model
    path, device = Path(path), torch.device(device or "cpu")
    if dtype != "auto" and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"fxquant: load_quantized's dtype must be 'auto' or a floating torch.dtype, got {dtype!r}")
    stored = read_config(path)
    model = skeleton_of(path, device) if model is None else model
    dtype = checkpoint_dtype(path, stored) if dtype == "auto" else dtype
    config = stored.get("quantization_config") or {}
    method = config.get("quant_method")
    if method not in ("compressed-tensors", MXFP4_METHOD):
        raise ValueError(f"fxquant: {path / 'config.json'} holds no compressed-tensors or MXFP4 quantization_config")
    compressed = method == "compressed-tensors"  # else the experts quantized, every linear in high precision
    recipes = _recipes(model, config) if compressed else {}
    experts = _expert_recipes(model, config) if compressed else {}
    mxfp4 = [] if compressed else mxfp4_experts(model)
    expert_of = {linear: name for _, linears in experts.values() for linear, name in linears.items()}
    expert_of |= {name: name for name in mxfp4}  # its tensors are named after the experts module itself
    sharded = {}  # tensor-parallel layers (DTensor weights in the skeleton): each rank reads its shard
    for name, recipe in recipes.items():
        module = model.get_submodule(name)
        if isinstance(module, QuantizedLinear):
            continue
        weight = linear_weight(module)
        skeleton = QuantizedLinear.empty(weight.shape[1], weight.shape[0], recipe, bias=module.bias is not None,
                                         dtype=weight.dtype, device="meta")
        if isinstance(weight, DTensor):
            sharded[name] = sharded_layer(name, module, weight, recipe)
            skeleton.bias = module.bias  # a column-parallel bias: this rank's slice is read into it
            move_hooks(module, skeleton)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, skeleton)
    owners = defaultdict(list)  # id(tensor) -> every (module, attribute) holding it: ties are kept
    for module in model.modules():
        for key, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                owners[id(t)].append((module, key))
    pending = defaultdict(dict)  # quantized layer -> its checkpoint tensors, converted once all have arrived
    files = checkpoint_files(path)
    bar = tqdm(total=sum(len(stored_keys(file)) for file in files), desc="fxquant load_quantized", unit="tensor",
               disable=progress_hidden(progress))
    for file in files:
        with _opened(file, device) as f:
            for key in f.keys():  # noqa: SIM118  (safe_open handles have keys(), not iteration)
                bar.update()
                name, _, local = key.rpartition(".")
                if config.get("kv_cache_scheme") and kv_cache_scheme.is_scale_key(key):
                    continue  # the cache's, read by kv_scales_of(path)
                if name in recipes and local != "bias" or name in expert_of:
                    pending[name][local] = sharded[name].read(f, key) if name in sharded else f.get_tensor(key)
                    continue
                assign_tensor(model, key, functools.partial(read_parameter, f, key), owners, dtype)
    bar.close()
    for name, tensors in pending.items():
        if name in expert_of:
            continue
        module = model.get_submodule(name)
        rows, cols = sharded[name].shape if name in sharded else (module.out_features, module.in_features)
        parts = _conformed(from_checkpoint(tensors, recipes[name], rows, name), name, recipes[name], rows, cols)
        params = (sharded[name].parameters(parts) if name in sharded
                  else {key: nn.Parameter(t, requires_grad=False) for key, t in parts.items() if t is not None})
        for key in parts:
            setattr(module, key, params.get(key))  # None: a part this checkpoint's layer has not (a row scale)
    for name in mxfp4:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, from_mxfp4(name, model.get_submodule(name), pending[name]))
    for name, (recipe, linears) in experts.items():
        missing = [linear for linear in linears if linear not in pending]
        if missing:
            raise ValueError(f"fxquant: the checkpoint in {path} holds no tensors for {missing[:4]}, experts of {name}")
        parent, _, attr = name.rpartition(".")
        parts_of = lambda linear, rows, cols, recipe=recipe: _conformed(
            from_checkpoint(pending[linear], recipe, rows, linear), linear, recipe, rows, cols)
        setattr(model.get_submodule(parent), attr,
                stack_experts(model, name, model.get_submodule(name), recipe, parts_of))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if left:
        raise ValueError(f"fxquant: the checkpoint in {path} holds no values for {left[:8]}"
                         f"{' and more' if len(left) > 8 else ''}, still on the meta device. Fix: build the "
                         "skeleton under fxquant.empty_weights(), which computes the buffers no checkpoint holds "
                         "(rotary frequencies), or build those modules on the target device")
    return model


def read_config(path: Path) -> dict:
    """config.json of the checkpoint folder `path`, or an error naming what is missing or malformed."""
    if not path.is_dir():
        raise FileNotFoundError(f"fxquant: no checkpoint folder {path}. Fix: pass the folder save_quantized (or "
                                "llm-compressor) wrote, which holds config.json and model.safetensors")
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"fxquant: {path} holds no config.json, so no quantization_config to load by. Fix: "
                                "pass the folder save_quantized (or llm-compressor) wrote")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"fxquant: {file} is not valid JSON ({exc}). Fix: download or save it again") from exc


def checkpoint_dtype(path: Path, config: dict) -> torch.dtype:
    """The model's dtype a checkpoint declares (config.json's dtype, torch_dtype before transformers 5), else the
    dtype of its first floating-point high-precision tensor."""
    declared = config.get("dtype") or config.get("torch_dtype")
    if isinstance(declared, str) and isinstance(getattr(torch, declared.removeprefix("torch."), None), torch.dtype):
        return getattr(torch, declared.removeprefix("torch."))
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open handles have keys(), not iteration)
                stored = SAFETENSORS_DTYPES.get(f.get_slice(key).get_dtype())
                if stored is not None and "scale" not in key:  # scales are fp32 in any model
                    return stored
    return torch.get_default_dtype()


def _opened(file: Path, device: torch.device):
    try:
        return safe_open(str(file), framework="pt", device=str(device))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"fxquant: {file} is not a whole safetensors file ({exc}): truncated or partly downloaded. "
                         "Fix: download or save it again") from exc


@functools.cache
def _part_layouts(recipe: str, rows: int, cols: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of each part a `recipe` layer of [rows, cols] holds."""
    empty = QuantizedLinear.empty(cols, rows, recipe, bias=False, dtype=torch.bfloat16, device="meta")
    return {key: (getattr(empty, key).shape, getattr(empty, key).dtype) for key in empty.part_names()
            if getattr(empty, key) is not None}


def _conformed(parts: dict[str, torch.Tensor], name: str, recipe: str, rows: int, cols: int) -> dict:
    """`parts`, once each has the shape and dtype the model's layer holds; else an error naming the tensor."""
    for key, t in ((key, t) for key, t in parts.items() if t is not None):
        shape, dtype = _part_layouts(recipe, rows, cols).get(key, (t.shape, t.dtype))
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"fxquant: {name}'s {key} from the checkpoint is {tuple(t.shape)} {t.dtype}, where the "
                             f"model's {recipe} layer of [{rows}, {cols}] holds {tuple(shape)} {dtype}. Fix: build "
                             "the skeleton from the checkpoint's own config.json")
    return parts


def _matching(key: str, tensor: torch.Tensor, current: torch.Tensor, dtype) -> torch.Tensor:
    """`tensor` for the model's `current`: the same shape; where both are floating point, `dtype` (the model's,
    as transformers' loaders cast); an error naming the tensor otherwise."""
    if tensor.shape != current.shape:
        raise ValueError(f"fxquant: checkpoint tensor {key} is {tuple(tensor.shape)}, the model's is "
                         f"{tuple(current.shape)}. Fix: build the skeleton from the checkpoint's own config.json")
    if tensor.is_floating_point() and current.is_floating_point():
        return tensor.to(dtype)
    if tensor.dtype == current.dtype:
        return tensor
    raise ValueError(f"fxquant: checkpoint tensor {key} is {tensor.dtype}, the model's is {current.dtype}")


def stored_keys(file: Path) -> list[str]:
    """The tensors' names in a safetensors file, from its header (a truncated file is refused naming it)."""
    with _opened(file, torch.device("cpu")) as f:
        return list(f.keys())  # noqa: SIM118  (safe_open handles have keys(), not iteration)


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, or model.safetensors; an error naming the file
    that is missing."""
    if (path / INDEX).exists():
        files = sorted({path / f for f in json.loads((path / INDEX).read_text())["weight_map"].values()})
    elif (path / "model.safetensors").exists():
        files = [path / "model.safetensors"]
    else:
        raise FileNotFoundError(f"fxquant: {path} holds neither model.safetensors nor {INDEX}. Fix: download or "
                                "save the checkpoint's weights into it")
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(f"fxquant: {path / INDEX} names {missing}, which {path} does not hold. Fix: download "
                                "or save the checkpoint again")
    return files


def assign_tensor(model: nn.Module, key: str, read, owners, dtype) -> None:
    """Put checkpoint tensor `key`, read(the model's tensor there), in place of the model's `key` and of every
    attribute tied to it."""
    name, _, attr = key.rpartition(".")
    module = model.get_submodule(name)
    if attr not in module._parameters and attr not in module._buffers:
        raise KeyError(f"fxquant: checkpoint tensor {key} has no place in the model")
    current = module._parameters.get(attr, module._buffers.get(attr))
    tensor = read(current)
    if current is not None:
        tensor = _matching(key, tensor, current, dtype)
    is_param = attr in module._parameters
    value = nn.Parameter(tensor, requires_grad=current is not None and current.requires_grad) if is_param else tensor
    for owner, owner_attr in owners.get(id(current), [(module, attr)]):
        (owner._parameters if is_param else owner._buffers)[owner_attr] = value


def stored_kv_scales(path) -> list[tuple[float, float]]:
    """The static KV-cache scales a checkpoint's kv_cache_scheme holds, one (k, v) pair per attention layer."""
    path = Path(path)
    if (read_config(path).get("quantization_config") or {}).get("kv_cache_scheme") != kv_cache_scheme.SCHEME:
        raise ValueError(f"fxquant: {path / 'config.json'} has no per-tensor fp8 kv_cache_scheme "
                         f"({kv_cache_scheme.SCHEME}); per-token scales need none: FP8StaticCache(kv_scales=None)")
    tensors = {}
    for file in checkpoint_files(path):
        with _opened(file, torch.device("cpu")) as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys() if kv_cache_scheme.is_scale_key(key)})  # noqa: SIM118
    return kv_cache_scheme.pairs_from(tensors)
