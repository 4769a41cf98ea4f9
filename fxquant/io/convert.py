"""`quantize_checkpoint`: a transformers checkpoint folder in, a compressed-tensors checkpoint out, as
`python -m fxquant quantize` runs it.

Where the checkpoint's tensors are named as the model's parameters (dense models), it streams: the model is a
skeleton on the meta device (`empty_weights`), each safetensors file is read into it in turn, and the layers that
file completed are quantized at once, so the peak is the quantized model plus one file's high-precision tensors.
Where they are not (transformers converts MoE checkpoints' per-expert tensors into its fused experts as it loads),
the model is loaded whole by `from_pretrained` on the CPU and moved to the device, then quantized layer by layer: the
peak is the high-precision model.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from tqdm.auto import tqdm

from fxquant.compile.lint import refuse_errors
from fxquant.config import AUTO, QuantConfig, from_options
from fxquant.io.checkpoint import (
    assign_tensor,
    checkpoint_dtype,
    checkpoint_files,
    read_config,
    save_quantized,
    stored_keys,
)
from fxquant.modules.inplace import (
    finish,
    linear_weight,
    progress_hidden,
    quantize_,
    quantize_layers,
    weight_findings_of,
)
from fxquant.modules.quantized_experts import is_experts
from fxquant.modules.skeleton import empty_weights

PROMPT = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])


def quantize_checkpoint(source, target, config: QuantConfig | dict | str | None = None, *, device="cpu",
                        dtype: torch.dtype | str = "auto", progress: bool | None = None) -> str:
    """Quantize the transformers checkpoint in the folder `source` (config.json and safetensors) under `config` (the
    backend's options, or a recipe's name) on `device`, and write it to the folder `target` with `save_quantized`.
    High-precision tensors keep the checkpoint's dtype (dtype="auto"), or take `dtype`. Returns how it ran:
    "streamed" (one file at a time) or "loaded whole"."""
    source, config = Path(source), from_options(config)
    if config.recipe == AUTO:
        raise ValueError("fxquant: recipe='auto' measures each layer on sample inputs, which a checkpoint does not "
                         "carry. Fix: fxquant.quantize_(model, {'recipe': 'auto'}, example_inputs=...) then "
                         "fxquant.save_quantized, or pin recipes with layer_recipes")
    stored = read_config(source)
    if stored.get("quantization_config"):
        method = stored["quantization_config"].get("quant_method")
        raise ValueError(f"fxquant: {source} is already quantized ({method}): quantizing its codes again would round "
                         "twice. Fix: start from the high-precision checkpoint")
    dtype = checkpoint_dtype(source, stored) if dtype == "auto" else dtype
    hf_config = transformers.AutoConfig.from_pretrained(source)
    with torch.device(device), empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    files = checkpoint_files(source)
    places = {name for name, _ in (*model.named_parameters(remove_duplicate=False), *model.named_buffers())}
    keys = {key for file in files for key in stored_keys(file)}
    if keys <= places:
        _stream(model, files, config, device, dtype, progress)
        how = "streamed"
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(device)
        # a few tokens to run the model on once: quantize_ finds its routers by structure, as the backend does
        quantize_(model, config, example_inputs=(PROMPT.to(device),), progress=progress)
        how = "loaded whole"
    save_quantized(model, target)
    return how


def _stream(model, files: list[Path], config: QuantConfig, device, dtype, progress) -> None:
    """Each file's tensors into the skeleton, then the layers whose weights are all read quantized, file by file."""
    owners = {}  # id(tensor) -> every (module, attribute) holding it: a tied lm_head follows its embedding
    for module in model.modules():
        for key, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                owners.setdefault(id(t), []).append((module, key))
    layers, findings, done = [], [], set()
    for file in tqdm(files, desc="fxquant quantize", unit="file", disable=progress_hidden(progress)):
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118
                assign_tensor(model, key, lambda current, key=key, f=f: f.get_tensor(key), owners, dtype)
        ready = lambda m: all(p.device.type != "meta" for p in m.parameters())
        linears = [name for name, m in model.named_modules()
                   if name not in done and linear_weight(m) is not None and ready(m)]
        experts = [name for name, m in model.named_modules() if name not in done and is_experts(m) and ready(m)]
        findings += weight_findings_of(model, linears, experts)
        refuse_errors(findings, "quantize")  # before this file's layers are changed, and before anything is written
        layers += quantize_layers(model, linears, experts, config, progress=False)
        done.update(linears + experts)
    left = [name for name, t in model.named_parameters() if t.device.type == "meta"]
    if left:
        raise ValueError(f"fxquant: the checkpoint holds no values for {left[:8]}: an incomplete download?")
    finish(model, config, layers, findings)
