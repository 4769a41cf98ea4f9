"""The compressed-tensors checkpoint format, layer by layer: which quantization scheme each recipe is, and how a
QuantizedLinear's parts map to the tensors that format stores (layouts and conventions as compressed-tensors'
compressors write them).

- float-quantized (fp8_row, fp8_block, fp8_tensor): `weight` (e4m3 codes) and `weight_scale`, dequantized as
  weight * weight_scale.
- pack-quantized (int8_wo, int4_wo): `weight_packed`, int32 words each holding 32 / bits codes, the first in the
  low bits, every code offset by 2**(bits - 1) (the signed value q is stored as q + 8 for int4); `weight_scale`;
  `weight_shape`; for asymmetric int4, `weight_zero_point`, signed like the codes and packed the same way down the
  rows. Dequantized as (q - zero_point) * weight_scale. fxquant's unsigned int4 codes and zero points are exactly
  those offset values, so (q - z) is unchanged. Symmetric int4 (int4_sym_wo, GPTQ's layout) has no zero point:
  fxquant's two's complement nibbles become the offset ones by flipping each nibble's top bit, and back.
- mxfp4-pack-quantized (mxfp4_wo): `weight_packed`, two e2m1 codes a byte, low nibble first, sign in bit 3, as
  fxquant packs them; `weight_scale`, the E8M0 exponent bits as uint8. Dequantized as value * 2**(e - 127).
- mxfp8-quantized (mxfp8): `weight`, e4m3 codes; `weight_scale`, E8M0 exponent bits of each 32 along K as uint8;
  activations quantized dynamically the same way. Dequantized as code * 2**(e - 127).
- nvfp4-pack-quantized (nvfp4_wo): `weight_packed` as for MXFP4; `weight_scale`, e4m3 scales of 16; and
  `weight_global_scale`, the reciprocal of fxquant's (448 * 6 / amax, not amax / (448 * 6)). compressed-tensors
  dequantizes as value * (scale / global), fxquant (as vLLM's kernels do) as value * scale * (1 / global): where the
  division and the multiply by the rounded reciprocal round apart, a weight differs by an ulp.
"""

from __future__ import annotations

import torch

from fxquant.config import RECIPES
from fxquant.numerics.row_powers_of_two import SCALE_MODE as ROW_POWERS_OF_TWO
from fxquant.numerics.row_powers_of_two import row_scale_of

FLOAT_QUANTIZED, PACK_QUANTIZED = "float-quantized", "pack-quantized"
SIGN_BIT = 0x80
NIBBLE_SIGN_BITS = 0x88  # both nibbles' top bits: a signed int4 code q becomes q + 8 by flipping it, and back
MXFP4_PACKED, NVFP4_PACKED, MXFP8_QUANTIZED = "mxfp4-pack-quantized", "nvfp4-pack-quantized", "mxfp8-quantized"
_FP8_ACTIVATIONS = dict(num_bits=8, type="float", symmetric=True, dynamic=True)
_MX = dict(strategy="group", group_size=32, scale_dtype="torch.uint8")  # E8M0 scales of 32, stored as uint8
_FORMATS = {"fp8_e4m3": FLOAT_QUANTIZED, "mxfp8": MXFP8_QUANTIZED, "int8": PACK_QUANTIZED, "int4": PACK_QUANTIZED,
            "mxfp4": MXFP4_PACKED, "nvfp4": NVFP4_PACKED}


def _strategy(granularity) -> dict:
    """A weight or activation granularity as compressed-tensors' strategy arguments."""
    if granularity in ("channel", "tensor", "token"):
        return {"strategy": granularity}
    kind, *sizes = granularity
    return {"strategy": "block", "block_structure": list(sizes)} if kind == "block" else {"strategy": "group",
                                                                                            "group_size": sizes[0]}


def writable(recipe: str) -> bool:
    """Whether compressed-tensors has a format for the recipe's weights."""
    return RECIPES[recipe].weight_fmt in _FORMATS


def scheme_of(recipe: str) -> tuple[str, dict, dict | None]:
    """The compressed-tensors format, weight arguments and input-activation arguments (None: weight-only) of a
    recipe, read from its LinearScheme, so that a recipe of an existing kind needs no entry here."""
    linear = RECIPES[recipe]
    fmt = linear.weight_fmt
    if not writable(recipe):
        raise ValueError(f"fxquant: recipe {recipe!r} has no compressed-tensors scheme here; checkpoints are written "
                         f"for {', '.join(filter(writable, RECIPES))}")
    if fmt == "fp8_e4m3":
        act = {0: "token", -1: "tensor"}.get(linear.act_group, ("group", linear.act_group))
        weights = dict(num_bits=8, type="float", symmetric=True, **_strategy(linear.weight_granularity))
        return FLOAT_QUANTIZED, dict(weights, dynamic=False), dict(_FP8_ACTIVATIONS, **_strategy(act))
    if fmt == "mxfp8":
        weights = dict(num_bits=8, type="float", symmetric=True, dynamic=False, **_MX)
        return MXFP8_QUANTIZED, weights, dict(_FP8_ACTIVATIONS, **_MX)
    if fmt in ("int8", "int4"):  # int8 is symmetric; int4 has a zero point per group unless its scheme says not
        weights = dict(num_bits=int(fmt[3:]), type="int", symmetric=fmt == "int8" or linear.symmetric,
                       **_strategy(linear.weight_granularity))
        # W4A8: dynamic e4m3 activations per token, the scheme vLLM's compressed-tensors W4A8-FP8 path loads
        activations = dict(_FP8_ACTIVATIONS, strategy="token") if linear.kind == "int4_fp8" else None
        return PACK_QUANTIZED, dict(weights, dynamic=False), activations
    if fmt == "mxfp4":
        return MXFP4_PACKED, dict(num_bits=4, type="float", symmetric=True, dynamic=False, **_MX), None
    return NVFP4_PACKED, dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                              dynamic=False, scale_dtype="torch.float8_e4m3fn"), None


def group_config(recipe: str, targets: list[str]) -> dict:
    """One config_groups entry of quantization_config."""
    fmt, weights, activations = scheme_of(recipe)
    return {"targets": targets, "weights": weights, "input_activations": activations, "format": fmt}


def recipe_of(group: dict, where: str) -> str:
    """The recipe that computes what a config_groups entry describes (the first whose scheme_of it matches); a clear
    error where none does."""
    for recipe in RECIPES:
        if writable(recipe) and _computes(recipe, group):
            return recipe
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    raise NotImplementedError(
        f"fxquant: {where}: no fxquant recipe computes this compressed-tensors scheme (weights {weights}, "
        f"input_activations {activations}); loadable: fp8 per channel / 128x128 block / per tensor and MXFP8 with "
        "dynamic activations; int8 per channel, int4 in groups of 128, MXFP4 and NVFP4, weight-only; symmetric int4 "
        "in groups of 128 with dynamic fp8 activations per token (W4A8)")


_COMPARED = ("type", "num_bits", "strategy", "group_size", "block_structure")  # what fixes the numbers


def _computes(recipe: str, group: dict) -> bool:
    """Whether `recipe` computes the scheme `group` describes: the same weight type, bits, strategy and block, the
    same symmetry for ints (compressed-tensors' default: symmetric), E8M0 scales for MXFP8, no activation order,
    and dynamic activations of the same strategy, or none."""
    _, ours, our_activations = scheme_of(recipe)
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    if any(_value(weights.get(key)) != _value(ours[key]) for key in _COMPARED if key in ours):
        return False
    if ours["type"] == "int" and (weights.get("symmetric", True) != ours["symmetric"]
                                  or weights.get("actorder") not in (None, "none")):
        return False
    if RECIPES[recipe].kind == "mxfp8" and not _e8m0(weights):
        return False
    if our_activations is None or not activations:
        return our_activations is None and not activations
    return activations.get("dynamic") is True and all(
        _value(activations.get(key)) == _value(our_activations[key])
        for key in ("type", "num_bits", "strategy", "group_size") if key in our_activations)


def _value(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def _e8m0(args: dict) -> bool:
    """MX scales: E8M0 exponents, stored as uint8."""
    return str(args.get("scale_dtype")) in ("torch.uint8", "uint8")


def _offset_binary(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes q, as bytes, -> q + 128 as uint8, which pack-quantized stores; its own inverse."""
    return codes ^ SIGN_BIT  # q + 128 mod 256 flips only the sign bit of q's two's complement byte


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes (two 4-bit codes a byte, low nibble first, or one 8-bit code) -> int32 words along each row."""
    # Through 1-D: a size-1 leading dim may carry any stride, which view() to a wider dtype refuses.
    return codes.contiguous().reshape(-1).view(torch.int32).reshape(*codes.shape[:-1], -1)


def _nibbles_down(values: torch.Tensor) -> torch.Tensor:
    """[N, G] 4-bit values (uint8) packed down the rows: [N / 8, G] int32, the first row in the low bits."""
    t = values.t().contiguous()  # [G, N]
    return _pack_rows(t[:, 0::2] | (t[:, 1::2] << 4)).t().contiguous()


def _unnibble_down(words: torch.Tensor, rows: int) -> torch.Tensor:
    """Inverse of _nibbles_down: [rows / 8, G] int32 -> [rows, G] uint8."""
    packed = words.t().contiguous().view(torch.uint8)  # [G, rows / 2]
    values = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :rows]
    return values.t().contiguous()


def to_checkpoint(layer, recipe: str) -> dict[str, torch.Tensor]:
    """The tensors compressed-tensors stores for a QuantizedLinear (local names: weight, weight_scale, ...)."""
    n, k = layer.out_features, layer.in_features
    scale = layer.weight_scale.detach().float()  # fp32: dequantization in compressed-tensors then equals ours
    fmt, linear = scheme_of(recipe)[0], RECIPES[recipe]
    if fmt == FLOAT_QUANTIZED:
        return {"weight": layer.weight.detach(), "weight_scale": scale.reshape(1) if scale.dim() == 0 else scale}
    if fmt in (MXFP4_PACKED, MXFP8_QUANTIZED):
        key = "weight_packed" if fmt == MXFP4_PACKED else "weight"
        return {key: layer.weight.detach(), "weight_scale": layer.weight_scale.detach().view(torch.uint8)}
    if fmt == NVFP4_PACKED:
        return {"weight_packed": layer.weight.detach(), "weight_scale": layer.weight_scale.detach(),
                "weight_global_scale": (1.0 / layer.weight_global_scale.detach().float()).reshape(1)}
    tensors = {"weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if linear.weight_fmt == "int8":
        tensors["weight_packed"] = _pack_rows(_offset_binary(layer.weight.detach().view(torch.uint8)))
    elif linear.symmetric:
        tensors["weight_packed"] = _pack_rows(layer.weight.detach() ^ NIBBLE_SIGN_BITS)
    else:
        tensors["weight_packed"] = _pack_rows(layer.weight.detach())
        tensors["weight_zero_point"] = _nibbles_down(layer.weight_zero_point.detach())
    return tensors


def stored_names(recipe: str) -> tuple[str, ...]:
    """The tensors of a layer that loading needs (int4's zero point is not among them: symmetric checkpoints have
    none)."""
    fmt = scheme_of(recipe)[0]
    if fmt in (FLOAT_QUANTIZED, MXFP8_QUANTIZED):
        return ("weight", "weight_scale")
    return ("weight_packed", "weight_scale") + (("weight_global_scale",) if fmt == NVFP4_PACKED else ())


def from_checkpoint(tensors: dict[str, torch.Tensor], recipe: str, out_features: int,
                    name: str) -> dict[str, torch.Tensor]:
    """QuantizedLinear parts from the tensors compressed-tensors stores for the layer `name`, which it takes over:
    the codes are the stored tensors (int8's turned into codes in place), never a copy. Scales become fp32, exactly
    (MX scales stay E8M0)."""
    missing = [key for key in stored_names(recipe) if key not in tensors]
    if missing:
        raise ValueError(f"fxquant: the checkpoint holds no {', '.join(f'{name}.{key}' for key in missing)}, which "
                         f"its {recipe} layer {name} needs. Fix: a complete checkpoint (download or save it again)")
    fmt, linear = scheme_of(recipe)[0], RECIPES[recipe]
    if fmt in (MXFP4_PACKED, MXFP8_QUANTIZED):
        exponents = tensors["weight_scale"]
        if exponents.dtype != torch.uint8:
            raise ValueError(f"fxquant: {recipe} weight_scale is {exponents.dtype}, expected uint8 E8M0 exponents")
        codes = tensors["weight_packed" if fmt == MXFP4_PACKED else "weight"]
        if fmt == MXFP8_QUANTIZED and codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fxquant: mxfp8 weight is {codes.dtype}, expected float8_e4m3fn")
        return {"weight": codes, "weight_scale": exponents.view(torch.float8_e8m0fnu)}
    if fmt == NVFP4_PACKED:
        block_scale = tensors["weight_scale"]
        if block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fxquant: nvfp4 weight_scale is {block_scale.dtype}, expected float8_e4m3fn")
        global_scale = (1.0 / tensors["weight_global_scale"].float()).reshape(())  # fxquant multiplies by it
        return {"weight": tensors["weight_packed"], "weight_scale": block_scale, "weight_global_scale": global_scale}
    scale = tensors["weight_scale"].float()
    if fmt == FLOAT_QUANTIZED:
        codes = tensors["weight"]
        if codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fxquant: float-quantized weight is {codes.dtype}, expected float8_e4m3fn")
        return {"weight": codes, "weight_scale": scale.reshape(()) if linear.weight_granularity == "tensor" else scale}
    packed = tensors["weight_packed"].contiguous().view(torch.uint8)
    if linear.weight_fmt == "int8":  # in place: the layer's codes are the stored bytes, never a second copy
        return {"weight": packed.bitwise_xor_(SIGN_BIT).view(torch.int8), "weight_scale": scale}
    if linear.symmetric:
        codes = {"weight": packed.bitwise_xor_(NIBBLE_SIGN_BITS), "weight_scale": scale}
        if linear.scale_mode == ROW_POWERS_OF_TWO:  # the row-scaled GEMMs take scales of that form, wherever made
            codes["weight_row_scale"] = row_scale_of(scale)
        return codes
    zero_point = tensors.get("weight_zero_point")
    zero_point = (_unnibble_down(zero_point, out_features) if zero_point is not None
                  else torch.full(scale.shape, 8, dtype=torch.uint8, device=scale.device))  # none stored: q - 8
    return {"weight": packed, "weight_scale": scale, "weight_zero_point": zero_point}
