"""transformers' own MXFP4 checkpoints (`quant_method: "mxfp4"`, as GPT-OSS ships): the experts' weights stored
quantized, everything else in high precision.

Each experts module `name` stores, per projection (gate_up_proj, down_proj):
- `{name}.{projection}_blocks`, uint8 [E, N, K / 32, 16]: two e2m1 codes a byte, low nibble first, sign in bit 3;
- `{name}.{projection}_scales`, uint8 [E, N, K / 32]: the E8M0 exponent of each 32 along K, value * 2**(e - 127);
- `{name}.{projection}_bias`, [E, N], in high precision.

Rows are output channels (N), the layout fxquant's mxfp4_wo codes and scales already have: they are taken over as
stored, reshaped, never dequantized. transformers' `convert_moe_packed_tensors` reads the same bytes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fxquant.modules.quantized_experts import PROJECTIONS, QuantizedExperts, experts_shape, gate_owner, is_experts

MXFP4_METHOD = "mxfp4"
SUFFIXES = ("_blocks", "_scales", "_bias")


def mxfp4_experts(model: nn.Module) -> list[str]:
    """The experts modules an MXFP4 checkpoint quantizes: every transformers experts module of the model."""
    return [name for name, module in model.named_modules() if is_experts(module)]


def from_mxfp4(name: str, module: nn.Module, tensors: dict[str, torch.Tensor]) -> QuantizedExperts:
    """A QuantizedExperts (mxfp4_wo) for the skeleton's experts module `name`, from the checkpoint's tensors of it
    (keys as `gate_up_proj_blocks`); an error naming the tensor where one is missing or of another shape."""
    num_experts, two_inter, hidden = experts_shape(module)
    shapes = {"gate_up_proj": (num_experts, two_inter, hidden), "down_proj": (num_experts, hidden, two_inter // 2)}
    parts, biases = {}, {}
    for projection in PROJECTIONS:
        missing = [projection + s for s in SUFFIXES if projection + s not in tensors]
        if missing:
            raise ValueError(f"fxquant: the checkpoint holds no {', '.join(f'{name}.{m}' for m in missing)}, which "
                             f"its MXFP4 experts need. Fix: a complete checkpoint (download or save it again)")
        e, n, k = shapes[projection]
        blocks, scales = tensors[projection + "_blocks"], tensors[projection + "_scales"]
        for key, t, want in ((projection + "_blocks", blocks, (e, n, k // 32, 16)),
                             (projection + "_scales", scales, (e, n, k // 32))):
            if tuple(t.shape) != want or t.dtype != torch.uint8:
                raise ValueError(f"fxquant: {name}.{key} is {tuple(t.shape)} {t.dtype}, where the model's experts "
                                 f"need {want} torch.uint8. Fix: build the skeleton from the checkpoint's own "
                                 "config.json")
        parts[projection] = blocks.reshape(e, n, k // 2)
        parts[projection + "_scale"] = scales.view(torch.float8_e8m0fnu)
        bias = tensors[projection + "_bias"]
        biases[projection] = bias.to(getattr(module, projection + "_bias", bias).dtype)  # the model's dtype
    return QuantizedExperts(num_experts, hidden, two_inter // 2, "mxfp4_wo", parts, getattr(module, "act_fn", None),
                            biases, gate_owner(module))
