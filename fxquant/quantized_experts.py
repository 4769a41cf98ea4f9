"""`QuantizedExperts`: what `quantize_` puts in place of an MoE layer's experts.

transformers 5.x keeps each MoE layer's experts as one module with two 3-D parameters, gate_up_proj [E, 2I, H]
(gate rows first, then up) and down_proj [E, H, I], and chooses its forward by `config._experts_implementation`
(an eager loop over experts, batched_mm or grouped_mm). The quantized module holds each projection's codes and
scales as frozen parameters, as `QuantizedLinear` does, and always runs the grouped form: tokens sorted by expert
(`fxquant.sort_by_expert`), the grouped ops `linear_ops.emit_linear` emits given offsets, and the routing
weights applied to the rows put back in token order, summed over each token's experts, as transformers' grouped_mm
experts compute them. So every implementation setting runs quantized, eagerly and under any compile backend.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fxquant.config import RECIPES
from fxquant.linear_ops import emit_linear, run_now
from fxquant.passes.quantize_linear import quantize_weight
from fxquant.quantized_linear import PARTS, FrozenParts

PROJECTIONS = ("gate_up_proj", "down_proj")


def experts_layout_reason(module: nn.Module) -> str | None:
    """Why `module` (one with 3-D gate_up_proj and down_proj) is not an experts layout QuantizedExperts computes,
    or None."""
    unsupported = [flag for flag, want in (("has_gate", True), ("is_transposed", False), ("has_bias", False),
                                           ("is_concatenated", True), ("has_post_expert_norm", False))
                   if getattr(module, flag, want) != want]
    if unsupported:
        return f"experts layout not supported by quantize_ ({', '.join(unsupported)})"
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":  # transformers' act_fn(gate) * up
        return "experts with their own gating function are not supported by quantize_"
    return None


def is_experts(module: nn.Module) -> bool:
    """transformers' experts module: 3-D parameters gate_up_proj and down_proj."""
    return all(isinstance(getattr(module, name, None), nn.Parameter) and getattr(module, name).dim() == 3
               for name in PROJECTIONS)


class QuantizedExperts(FrozenParts):
    """An MoE layer's experts, gate_up_proj [E, 2I, H] and down_proj [E, H, I], held quantized under `recipe`;
    forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, recipe: str, parts: dict, act_fn):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"fxquant: unknown recipe {recipe!r}; valid: {', '.join(RECIPES)}")
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden_dim, intermediate_dim
        self.recipe, self.act_fn = recipe, act_fn
        for name in self.part_names():
            tensor = parts.get(name)
            self.register_parameter(name, None if tensor is None else nn.Parameter(tensor, requires_grad=False))

    @classmethod
    def from_module(cls, module: nn.Module, recipe: str) -> QuantizedExperts:
        """Quantize transformers' experts module, expert by expert, on its weights' device."""
        parts = {}
        for projection in PROJECTIONS:
            q = quantize_weight(getattr(module, projection).detach(), recipe)
            parts.update({_part(projection, name): getattr(q, field) for name, field in PARTS})
        num_experts, two_i, hidden = module.gate_up_proj.shape
        return cls(num_experts, hidden, two_i // 2, recipe, parts, module.act_fn)

    def part_names(self) -> list[str]:
        return [_part(projection, name) for projection in PROJECTIONS for name, _ in PARTS]

    def _consts(self, projection: str) -> tuple:
        return tuple(getattr(self, _part(projection, name)) for name, _ in PARTS)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        scheme, k = RECIPES[self.recipe], top_k_index.shape[-1]
        order, inverse, offs = torch.ops.fxquant.sort_by_expert(top_k_index, self.num_experts)
        x = hidden_states.index_select(0, order // k)  # each (token, expert) pair's row, sorted by expert
        h = emit_linear(run_now, scheme, x, self._consts("gate_up_proj"), None, 2 * self.intermediate_dim, x.dtype,
                        offs)
        gate, up = h.chunk(2, dim=-1)
        h = emit_linear(run_now, scheme, self.act_fn(gate) * up, self._consts("down_proj"), None, self.hidden_dim,
                        x.dtype, offs)
        weighted = h.index_select(0, inverse) * top_k_weights.reshape(-1, 1)
        return weighted.view(-1, k, self.hidden_dim).sum(dim=1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, recipe={self.recipe}")


def _part(projection: str, name: str) -> str:
    """gate_up_proj + weight_scale -> gate_up_proj_scale; the codes keep the projection's own name."""
    return projection + name.removeprefix("weight")
