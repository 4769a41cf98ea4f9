"""How an fxquant op is declared: `define` (schema and implementation, and the trace into it while a package is
compiled) and `fake` (its shapes)."""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

from fxquant.kernels.launch import inlined


def define(schema: str, kernel, tags: tuple[torch.Tag, ...] = ()) -> torch._ops.OpOverloadPacket:
    """Define `fxquant::<schema>` with `kernel` as its implementation on every device; returns the op. While
    kernels are inlined (fxquant.io.export.package), functionalization traces into `kernel`, as into a
    torch.library.triton_op's: its torch ops and its Triton launches; otherwise the op stays whole. tags: the op's
    (torch.Tag.flexible_layout: Inductor hands it its inputs in the layout they have)."""
    name, signature = schema.split("(", 1)
    torch.library.define(f"fxquant::{name}", "(" + signature, tags=tags)
    torch.library.impl(f"fxquant::{name}", "default", kernel)

    def traced_into(mode, op, types, args, kwargs):
        if not inlined():
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return kernel(*args, **kwargs)

    torch.library.register_torch_dispatch(f"fxquant::{name}", FunctionalTensorMode, traced_into)
    return getattr(torch.ops.fxquant, name)


def fake(name: str):
    return torch.library.register_fake(f"fxquant::{name}")
