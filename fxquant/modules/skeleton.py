"""`empty_weights()`: build a model skeleton for `load_quantized` without allocating its weights."""

from __future__ import annotations

import contextlib

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
