"""`QuantizedLinear`: what `quantize_` puts in place of a linear layer (nn.Linear, GPT-2's Conv1D).

The quantized weight is a module swap, not a tensor subclass. Its codes and scales are the module's parameters
(frozen, requires_grad=False), so they are the model's state: `state_dict()`, `load_state_dict()`, `.to()`,
`copy.deepcopy`, `torch.compile` (any backend) and `torch.export` treat them as weights, with no subclass support
needed from torch 2.11 to 2.14; checkpoint formats that store a weight's codes and scales as separate tensors map
onto them one to one. `forward` runs the same fxquant ops the backend's graph rewrite inserts (`linear_ops`), so
`backend="fxquant"` finds them already quantized and only fuses around them.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxquant.config import RECIPES
from fxquant.modules.sharded_linear import sharded_forward, sharded_parts
from fxquant.numerics.granularity import as_granularity
from fxquant.numerics.quantized import Quantized
from fxquant.numerics.reference import DEFAULT_SCALE_MODE, default_granularity
from fxquant.quantization.linear_ops import emit_linear, run_now
from fxquant.quantization.weight_quantization import quantize_weight

# (name of the parameter, field of Quantized); None fields are registered as None parameters
PARTS = (("weight", "data"), ("weight_scale", "scale"), ("weight_global_scale", "global_scale"),
         ("weight_zero_point", "zero_point"), ("weight_row_scale", "row_scale"))
PACKED_FORMATS = ("int4", "mxfp4", "nvfp4")
SHAPE_ROWS = 128  # rows quantized to learn each part's shape: a multiple of every block's rows (16, 32, 128)


class FrozenParts(nn.Module):
    """A module whose quantized parts (codes and scales, named by `part_names`) keep their formats through dtype
    changes: device moves apply to every parameter, a dtype change (model.half(), .to(torch.bfloat16)) only to the
    others (a bias), so the codes and scales stay exact."""

    def part_names(self) -> list[str]:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        kept = {name: getattr(self, name) for name in self.part_names() if getattr(self, name) is not None}
        before = {name: (p.data, p.dtype) for name, p in kept.items()}
        super()._apply(fn, recurse)
        for name, (data, dtype) in before.items():
            param = getattr(self, name)
            if param.dtype != dtype:
                param.data = data.to(param.device)
        return self


class QuantizedLinear(FrozenParts):
    """y = x @ W.T + b for W [out_features, in_features] held quantized under `recipe`; b stays in high precision."""

    def __init__(self, in_features: int, out_features: int, recipe: str, parts: dict, bias: torch.Tensor | None):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"fxquant: unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
        self.in_features, self.out_features, self.recipe = in_features, out_features, recipe
        for name, _ in PARTS:
            tensor = parts.get(name)
            self.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str) -> QuantizedLinear:
        """Quantize `weight` [N, K] (on its own device) under `recipe`."""
        q = quantize_weight(weight, recipe)
        parts = {name: getattr(q, field) for name, field in PARTS}
        return cls(weight.shape[1], weight.shape[0], recipe, parts, bias)

    @classmethod
    def from_sharded_weight(cls, weight: DTensor, bias: torch.Tensor | None, recipe: str, dim: int) -> QuantizedLinear:
        """Quantize this rank's shard of a tensor-parallel `weight` (sharded along `dim`, as `shard_dim` found):
        the parts are DTensors whose local tensors are the shard's codes and scales."""
        q = quantize_weight(weight.to_local(), recipe)
        parts = sharded_parts({name: getattr(q, field) for name, field in PARTS}, weight, dim)
        return cls(weight.shape[1], weight.shape[0], recipe, parts, bias)

    @classmethod
    def empty(cls, in_features: int, out_features: int, recipe: str, *, bias: bool, dtype: torch.dtype,
              device=None) -> QuantizedLinear:
        """A skeleton with uninitialized parts of the right shapes and dtypes (device "meta" allocates nothing),
        for `load_state_dict(..., assign=True)` or a checkpoint loader to fill."""
        sample = quantize_weight(torch.zeros(SHAPE_ROWS, in_features, dtype=dtype), recipe)
        parts = {}
        for name, field in PARTS:
            t = getattr(sample, field)
            if t is not None:
                shape = (t.shape[0] * out_features // SHAPE_ROWS, *t.shape[1:]) if t.dim() else ()
                parts[name] = torch.empty(shape, dtype=t.dtype, device=device)
        return cls(in_features, out_features, recipe, parts,
                   torch.empty(out_features, dtype=dtype, device=device) if bias else None)

    def part_names(self) -> list[str]:
        return [name for name, _ in PARTS]

    def quantized_weight(self) -> Quantized:
        """The weight as a `Quantized` (this rank's shard of a tensor-parallel layer), for `fxquant.dequantize`,
        which gives it in fp32 by default (the bias's dtype where there is one): the layer keeps no other dtype."""
        scheme = RECIPES[self.recipe]
        parts = {field: getattr(self, name) for name, field in PARTS}
        parts = {field: None if t is None else (t.to_local() if isinstance(t, DTensor) else t).detach()
                 for field, t in parts.items()}
        codes = parts["data"]
        packed = scheme.weight_fmt in PACKED_FORMATS  # two 4-bit codes a byte
        shape = torch.Size((codes.shape[0], codes.shape[1] * (2 if packed else 1)))
        granularity = (default_granularity(scheme.weight_fmt) if scheme.weight_granularity is None
                       else as_granularity(scheme.weight_granularity))
        dtype = self.bias.dtype if self.bias is not None else torch.float32
        scale_mode = scheme.scale_mode if parts["row_scale"] is not None else DEFAULT_SCALE_MODE.get(scheme.weight_fmt)
        return Quantized(fmt=scheme.weight_fmt, granularity=granularity, shape=shape, dtype=dtype,
                         scale_mode=scale_mode, **parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features]
        if isinstance(self.weight, DTensor):
            return sharded_forward(self, x)
        consts = tuple(getattr(self, name) for name, _ in PARTS)
        return emit_linear(run_now, RECIPES[self.recipe], x, consts, self.bias, self.out_features, x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}, "
                f"bias={self.bias is not None}")
