"""`QuantizedExperts`: what `quantize_` puts in place of an MoE layer's experts.

transformers 5.x keeps each MoE layer's experts as one module with two 3-D parameters, gate_up_proj [E, 2I, H]
(gate rows first, then up) and down_proj [E, H, I], and chooses its forward by `config._experts_implementation`
(an eager loop over experts, batched_mm or grouped_mm). Some store both transposed ([E, H, 2I], [E, I, H]), add a
bias per expert, and gate with a function of their own (GPT-OSS: interleaved gate and up rows, clamped). The
quantized module holds each projection's codes and scales as frozen parameters, [E, N, K] whatever the stored
layout, as `QuantizedLinear` does, with the biases in high precision, and always runs the grouped form: tokens
sorted by expert (`fxquant.sort_by_expert`), the grouped ops `linear_ops.emit_linear` emits given offsets, each
row's expert bias, the experts' own gate, and the routing weights applied to the rows put back in token order,
summed over each token's experts, as transformers' grouped_mm experts compute them. So every implementation setting
runs quantized, eagerly and under any compile backend.
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn as nn

from fxquant.config import RECIPES
from fxquant.modules.quantized_linear import PARTS, FrozenParts
from fxquant.quantization.linear_ops import emit_linear, run_now
from fxquant.quantization.weight_quantization import quantize_weight

PROJECTIONS = ("gate_up_proj", "down_proj")


def is_dense(module: nn.Module) -> bool:
    """Experts whose forward takes the hidden states alone, every expert over its own block of rows (Llama4's:
    bmm of [E, T, H] rows and gate_up_proj stored [E, H, 2I]), rather than rows with their routing."""
    forward = getattr(type(module), "forward", None)
    return forward is not None and len(inspect.signature(forward).parameters) == 2  # self, hidden_states


def stored_transposed(module: nn.Module) -> bool:
    """The experts store their weights [E, K, N]: declared (is_transposed, GPT-OSS), or dense experts (Llama4)."""
    return bool(getattr(module, "is_transposed", False)) or is_dense(module)


def experts_layout_reason(module: nn.Module) -> str | None:
    """Why `module` (one with 3-D gate_up_proj and down_proj) is not an experts layout QuantizedExperts computes,
    or None."""
    unsupported = [flag for flag, want in (("has_gate", True), ("has_post_expert_norm", False))
                   if getattr(module, flag, want) != want]
    if unsupported:
        return f"experts layout not supported by quantize_ ({', '.join(unsupported)})"
    if not getattr(module, "is_concatenated", True) and gate_owner(module) is None:
        return "interleaved gate and up rows without a gating function of the experts' own"
    num_experts, two_i, hidden = experts_shape(module)
    transposed = stored_transposed(module)
    if two_i % 2 or tuple(module.down_proj.shape) != ((num_experts, two_i // 2, hidden) if transposed else
                                                       (num_experts, hidden, two_i // 2)):
        layout = "[E, H, 2I] and [E, I, H] (stored transposed)" if transposed else "[E, 2I, H] and [E, H, I]"
        return (f"gate_up_proj {list(module.gate_up_proj.shape)} and down_proj {list(module.down_proj.shape)} are "
                f"not the layout {layout} the module declares")
    return None


def gate_owner(module: nn.Module) -> nn.Module | None:
    """For experts whose class gates with a function of its own (`_apply_gate`, not transformers' default
    act_fn(gate) * up), a parameterless copy of the module to call it on: the function reads the module's plain
    attributes (GPT-OSS: alpha, limit) and submodules, and the copy keeps no high-precision weight alive."""
    gate = getattr(type(module), "_apply_gate", None)
    if gate is None or gate.__name__ == "_default_apply_gate":
        return None
    owner = copy.copy(module)
    owner._parameters, owner._buffers, owner._modules = {}, {}, dict(module._modules)
    return owner


def experts_shape(module: nn.Module) -> tuple[int, int, int]:
    """(experts, 2 x intermediate, hidden) of transformers' experts module, in either stored layout."""
    num_experts, rows, cols = module.gate_up_proj.shape
    return (num_experts, cols, rows) if stored_transposed(module) else (num_experts, rows, cols)


def is_experts(module: nn.Module) -> bool:
    """transformers' experts module: 3-D parameters gate_up_proj and down_proj (a QuantizedExperts' codes are
    3-D too, but it is quantized already)."""
    return not isinstance(module, QuantizedExperts) and all(
        isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
        for name in PROJECTIONS)


class QuantizedExperts(FrozenParts):
    """An MoE layer's experts, gate_up_proj [E, 2I, H] and down_proj [E, H, I], held quantized under `recipe`;
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], or for `dense` experts
    forward(hidden_states [E * T, H]) -> [E * T, H], each expert over its own T rows (Llama4's)."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, recipe: str, parts: dict, act_fn,
                 biases: dict | None = None, owner: nn.Module | None = None, dense: bool = False):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"fxquant: unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.dense = dense
        self.recipe, self.act_fn = recipe, act_fn
        object.__setattr__(self, "gate_owner", owner)  # not a submodule: no weights of its own, not in the repr
        for name in self.part_names():
            tensor = parts.get(name)
            self.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))
        for projection in PROJECTIONS:
            bias = (biases or {}).get(projection)
            self.register_parameter(projection + "_bias", None if bias is None else
                                    nn.Parameter(bias.detach(), requires_grad=False))

    @classmethod
    def from_module(cls, module: nn.Module, recipe: str) -> QuantizedExperts:
        """Quantize transformers' experts module, expert by expert, on its weights' device."""
        parts, transposed = {}, stored_transposed(module)
        for projection in PROJECTIONS:
            weight = getattr(module, projection).detach()
            q = quantize_weight(weight.transpose(-2, -1) if transposed else weight, recipe)  # [E, N, K]
            parts.update({_part(projection, name): getattr(q, field) for name, field in PARTS})
        num_experts, two_i, hidden = experts_shape(module)
        biases = {p: getattr(module, p + "_bias", None) for p in PROJECTIONS} if getattr(module, "has_bias", False) \
            else None
        return cls(num_experts, hidden, two_i // 2, recipe, parts, getattr(module, "act_fn", None), biases,
                   gate_owner(module), is_dense(module))

    def part_names(self) -> list[str]:
        return [_part(projection, name) for projection in PROJECTIONS for name, _ in PARTS]

    def _consts(self, projection: str) -> tuple:
        return tuple(getattr(self, _part(projection, name)) for name, _ in PARTS)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None):
        if self.dense:
            return self._dense(hidden_states)
        scheme, k = RECIPES[self.recipe], top_k_index.shape[-1]
        order, inverse, offs = torch.ops.fxquant.sort_by_expert(top_k_index, self.num_experts)
        x = hidden_states.index_select(0, order // k)  # each (token, expert) pair's row, sorted by expert
        biased = self.gate_up_proj_bias is not None or self.down_proj_bias is not None
        experts = top_k_index.reshape(-1).index_select(0, order) if biased else None  # each sorted row's expert
        h = emit_linear(run_now, scheme, x, self._consts("gate_up_proj"), None, 2 * self.intermediate_dim, x.dtype,
                        offs)
        h = self._biased(h, "gate_up_proj", experts)
        h = emit_linear(run_now, scheme, self._gated(h), self._consts("down_proj"), None, self.hidden_dim, x.dtype,
                        offs)
        h = self._biased(h, "down_proj", experts)
        weighted = h.index_select(0, inverse) * top_k_weights.reshape(-1, 1)
        return weighted.view(-1, k, self.hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def _dense(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [E * T, H], expert e's rows the e-th block of T: the grouped ops over the blocks."""
        scheme, x = RECIPES[self.recipe], hidden_states.reshape(-1, self.hidden_dim)
        offs = torch.ops.fxquant.uniform_offsets(x, self.num_experts)
        h = emit_linear(run_now, scheme, x, self._consts("gate_up_proj"), None, 2 * self.intermediate_dim, x.dtype,
                        offs)
        return emit_linear(run_now, scheme, self._gated(h), self._consts("down_proj"), None, self.hidden_dim,
                           x.dtype, offs)

    def _biased(self, h: torch.Tensor, projection: str, experts: torch.Tensor) -> torch.Tensor:
        """h plus each row's expert bias, added to the rounded product as transformers' grouped experts add it."""
        bias = getattr(self, projection + "_bias")
        return h if bias is None else h + bias.index_select(0, experts).to(h.dtype)

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_owner is not None:
            return self.gate_owner._apply_gate(h)
        gate, up = h.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, recipe={self.recipe}" + (", dense" if self.dense else ""))


def _part(projection: str, name: str) -> str:
    """gate_up_proj + weight_scale -> gate_up_proj_scale; the codes keep the projection's own name."""
    return projection + name.removeprefix("weight")
