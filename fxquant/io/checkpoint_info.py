"""What a checkpoint holds, read from its config.json and its safetensors headers (no tensor is loaded): each
layer's format and bytes, and the totals, as `python -m fxquant inspect` prints them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from safetensors import safe_open

from fxquant.compile.report import format_rows, wrapped
from fxquant.io.checkpoint import checkpoint_files, read_config, recipe_of_layer

# a layer's stored codes: compressed-tensors' (packed or not), or a high-precision weight
WEIGHT_KEYS = ("weight_packed", "weight")
BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "U8": 1, "I8": 1,
         "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}


def summary(path) -> str:
    """The checkpoint in the folder `path`: a row per layer with a weight (its format, what it stores, its bytes),
    then the bytes by format and in all."""
    path = Path(path)
    quantization = read_config(path).get("quantization_config") or {}
    tensors = {}  # key -> (shape, safetensors dtype)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118  (safe_open handles have keys(), not iteration)
                part = f.get_slice(key)
                tensors[key] = (tuple(part.get_shape()), part.get_dtype())
    nbytes = lambda key: BYTES.get(tensors[key][1], 1) * _count(tensors[key][0])
    layers: dict[str, list[str]] = {}
    for key in tensors:
        layers.setdefault(key.rpartition(".")[0], []).append(key)
    rows, by_format = [("layer", "format", "stored", "bytes")], Counter()
    for name, keys in layers.items():
        weight = next((f"{name}.{k}" for k in WEIGHT_KEYS if f"{name}.{k}" in tensors), None)
        if weight is None or len(tensors[weight][0]) < 2:  # a norm's weight is no layer's
            continue
        recipe = recipe_of_layer(name, None, quantization) if quantization.get("config_groups") else None
        fmt = recipe or f"high precision ({tensors[weight][1].lower()})"
        shape, dtype = tensors[weight]
        stored = f"{weight.rpartition('.')[2]} {dtype} {'x'.join(map(str, shape))}" + (
            f" and {len(keys) - 1} more" if len(keys) > 1 else "")
        size = sum(nbytes(k) for k in keys)
        by_format[fmt] += size
        rows.append((name, fmt, stored, f"{size:,}"))
    total = sum(nbytes(key) for key in tensors)
    others = total - sum(by_format.values())
    lines = [*wrapped(f"checkpoint {path}: {len(rows) - 1} layers with a weight, {total:,} bytes in {len(tensors)} "
                      "tensors"), *format_rows(rows)]
    lines += wrapped("bytes by format: " + "; ".join(f"{fmt} {size:,}" for fmt, size in by_format.most_common())
                     + (f"; other tensors (norms, buffers) {others:,}" if others else ""))
    return "\n".join(lines)


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
