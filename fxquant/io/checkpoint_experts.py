"""MoE experts in compressed-tensors checkpoints: per-expert linears, as transformers' checkpoints hold them.

transformers 5 keeps a model's experts as 3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I], and merges the
checkpoint's per-expert linears into them when it loads one (its checkpoint conversion mapping): Mixtral's
`block_sparse_moe.experts.{e}.w1` (gate), `.w3` (up) and `.w2` (down); Qwen2-MoE's and its family's
`mlp.experts.{e}.gate_proj`, `.up_proj` and `.down_proj`. compressed-tensors' compressors and vLLM's loaders read
those per-expert linears, so save_quantized splits a QuantizedExperts into them, and load_quantized stacks them back,
codes and scales as stored: no expert is dequantized on the way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn as nn

from fxquant.config import RECIPES
from fxquant.modules.quantized_experts import PROJECTIONS, QuantizedExperts
from fxquant.modules.quantized_linear import PARTS
from fxquant.numerics.row_powers_of_two import SCALE_MODE as ROW_POWERS_OF_TWO
from fxquant.numerics.row_powers_of_two import row_scale_of

ROW_SCALE = "weight_row_scale"

# (the experts module's path in the checkpoint, from its path in the model; the gate, up and down linears' names)
MIXTRAL = ((".mlp.experts", ".block_sparse_moe.experts"), ("w1", "w3", "w2"))
QWEN2_MOE = ((".mlp.experts", ".mlp.experts"), ("gate_proj", "up_proj", "down_proj"))
LAYOUTS = {"mixtral": MIXTRAL, "minimax": MIXTRAL}  # every other MoE model_type: Qwen2-MoE's names


@dataclass
class ExpertLinear:
    """One expert's gate, up or down linear, in the attributes `compressed_tensors.to_checkpoint` reads."""

    in_features: int
    out_features: int
    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_global_scale: torch.Tensor | None
    weight_zero_point: torch.Tensor | None
    weight_row_scale: torch.Tensor | None


def expert_linear_names(model: nn.Module, name: str, num_experts: int) -> list[tuple[str, str, str]]:
    """The checkpoint's (gate, up, down) linear names of each expert of the experts module `name`."""
    (ours, theirs), linears = LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None), QWEN2_MOE)
    path = ("." + name).replace(ours, theirs, 1)[1:] if ("." + name).endswith(ours) else name
    return [tuple(f"{path}.{e}.{linear}" for linear in linears) for e in range(num_experts)]


def _rows(t: torch.Tensor | None, first: int, stop: int, total: int, name: str) -> torch.Tensor | None:
    """Rows [first, stop) of `total` of a per-row or per-block part (a scalar part is the whole's)."""
    if t is None or t.dim() == 0:
        return t
    if (first * t.shape[0]) % total or (stop * t.shape[0]) % total:
        raise ValueError(f"fxquant: {name}'s scale blocks straddle its gate and up rows ({total // 2} each); the "
                         "checkpoint stores them as two linears. Fix: a recipe whose blocks divide the intermediate "
                         "size, or keep these experts in high precision")
    return t[first * t.shape[0] // total: stop * t.shape[0] // total]


def split_experts(model: nn.Module, name: str, experts: QuantizedExperts) -> dict[str, ExpertLinear]:
    """The experts module `name` as the checkpoint's per-expert linears, views of its codes and scales."""
    if experts.dense:
        raise ValueError(f"fxquant: {name} runs every expert over every token (Llama4's dense experts), a layout "
                         "the per-expert linears of a compressed-tensors checkpoint do not describe. Fix: save "
                         "model.state_dict() with safetensors or torch.save, or keep every such experts module out "
                         rf"of quantize_ (skip=[r'\.{re.escape(name.rpartition('.')[2])}\.']) to save the rest")
    if experts.gate_owner is not None or any(getattr(experts, p + "_bias") is not None for p in PROJECTIONS):
        raise ValueError(f"fxquant: {name} has expert biases or a gating function of its own (GPT-OSS's layout), "
                         "which the per-expert linears of a compressed-tensors checkpoint do not hold. Fix: save "
                         "model.state_dict() with safetensors or torch.save, or keep every such experts module out "
                         f"of quantize_ (skip=[r'\\.{re.escape(name.rpartition('.')[2])}\\.']) to save the rest")
    hidden, inter = experts.hidden_dim, experts.intermediate_dim
    linears = {}
    for e, names in enumerate(expert_linear_names(model, name, experts.num_experts)):
        gate_up = [getattr(experts, "gate_up_proj" + part.removeprefix("weight")) for part, _ in PARTS]
        down = [getattr(experts, "down_proj" + part.removeprefix("weight")) for part, _ in PARTS]
        pick = lambda parts, e=e: [None if t is None else t[e] for t in parts]
        for linear, (first, stop) in zip(names[:2], ((0, inter), (inter, 2 * inter)), strict=True):
            linears[linear] = ExpertLinear(hidden, inter, *(_rows(t, first, stop, 2 * inter, name)
                                                            for t in pick(gate_up)))
        linears[names[2]] = ExpertLinear(inter, hidden, *pick(down))
    return linears


def stack_experts(model: nn.Module, name: str, module: nn.Module, recipe: str, parts_of) -> QuantizedExperts:
    """A QuantizedExperts for the skeleton's experts module `name`, from each checkpoint linear's QuantizedLinear
    parts (`parts_of(linear name, out_features, in_features)`): gate and up rows joined per expert, experts stacked."""
    num_experts, two_inter, hidden = module.gate_up_proj.shape
    stacked = {}
    for gate, up, down in expert_linear_names(model, name, num_experts):
        # a row scale holds for a linear's rows alone: found again below for the joined and stacked scales
        g, u, d = ({part: t for part, t in parts.items() if part != ROW_SCALE} for parts in (
            parts_of(gate, two_inter // 2, hidden), parts_of(up, two_inter // 2, hidden),
            parts_of(down, hidden, two_inter // 2)))
        for part in g:
            if g[part].dim() == 0 and not torch.equal(g[part], u[part]):
                raise ValueError(f"fxquant: {gate} and {up} have different {part} values; fxquant's experts keep "
                                 "one per expert for gate and up together. Fix: a checkpoint whose gate and up "
                                 "share it, or keep these experts in high precision")
        joined = {part: g[part] if g[part].dim() == 0 else torch.cat([g[part], u[part]]) for part in g}
        for projection, tensors in zip(PROJECTIONS, (joined, d), strict=True):
            for part, t in tensors.items():
                stacked.setdefault(projection + part.removeprefix("weight"), []).append(t)
    parts = {key: torch.stack(ts) for key, ts in stacked.items()}
    if RECIPES[recipe].scale_mode == ROW_POWERS_OF_TWO:
        for projection in PROJECTIONS:
            parts[projection + ROW_SCALE.removeprefix("weight")] = row_scale_of(parts[projection + "_scale"])
    return QuantizedExperts(num_experts, hidden, two_inter // 2, recipe, parts, module.act_fn)
