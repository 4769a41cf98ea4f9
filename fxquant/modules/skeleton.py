"""`empty_weights()`: build a model skeleton for `load_quantized` without allocating its weights; `skeleton_of`: the
transformers model a checkpoint folder's config.json names, built so."""

from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path

import torch
import torch.nn as nn


@contextlib.contextmanager
def empty_weights():
    """Modules built inside get their parameters on the meta device, where they take no memory, and their buffers
    where they are built. Non-persistent buffers, which no checkpoint holds (rotary frequencies, Gemma's embedding
    scale), are then computed as the model computes them, and `load_quantized` fills the rest.

        with fxquant.empty_weights():
            skeleton = LlamaForCausalLM(config)
        fxquant.load_quantized(skeleton, path, device="cuda")

    Each parameter is allocated (uninitialized) where it is built, then replaced by its meta twin before the
    module initializes it, so at most one parameter is held at a time."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if type(param) is nn.Parameter and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def skeleton_of(path: Path, device: torch.device) -> nn.Module:
    """The transformers model the checkpoint folder `path` holds, built under `empty_weights` with its buffers on
    `device`, in eval mode as from_pretrained returns it: the class config.json's `architectures` names, or
    AutoModelForCausalLM's choice where it names none."""
    if importlib.util.find_spec("transformers") is None:
        raise ImportError(f"fxquant: load_quantized({str(path)!r}) builds the model its config.json names with "
                          "transformers, which is not installed. Fix: pip install transformers, or build the skeleton "
                          "yourself and pass it: load_quantized(skeleton, path)")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    names = getattr(config, "architectures", None) or []
    if len(names) > 1 or names and not hasattr(transformers, names[0]):
        raise ValueError(f"fxquant: {path / 'config.json'} names the architectures {names}, not one class this "
                         "transformers has. Fix: build the skeleton under fxquant.empty_weights() and pass it: "
                         "load_quantized(skeleton, path)")
    with torch.device(device), empty_weights():
        if names:
            model = getattr(transformers, names[0])(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()
