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

FLOAT_QUANTIZED, PACK_QUANTIZED = "float-quantized", "pack-quantized"
SIGN_BIT = 0x80
NIBBLE_SIGN_BITS = 0x88  # both nibbles' top bits: a signed int4 code q becomes q + 8 by flipping it, and back
MXFP4_PACKED, NVFP4_PACKED, MXFP8_QUANTIZED = "mxfp4-pack-quantized", "nvfp4-pack-quantized", "mxfp8-quantized"
_FP8_ACTIVATIONS = dict(num_bits=8, type="float", symmetric=True, dynamic=True)
# recipe -> (format, weights args, input activation args or None)
SCHEMES = {
    "fp8_row": (FLOAT_QUANTIZED, dict(num_bits=8, type="float", symmetric=True, strategy="channel", dynamic=False),
                dict(_FP8_ACTIVATIONS, strategy="token")),
    "fp8_block": (FLOAT_QUANTIZED, dict(num_bits=8, type="float", symmetric=True, strategy="block",
                                        block_structure=[128, 128], dynamic=False),
                  dict(_FP8_ACTIVATIONS, strategy="group", group_size=128)),
    "fp8_tensor": (FLOAT_QUANTIZED, dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False),
                   dict(_FP8_ACTIVATIONS, strategy="tensor")),
    "mxfp8": (MXFP8_QUANTIZED, dict(num_bits=8, type="float", symmetric=True, strategy="group", group_size=32,
                                    dynamic=False, scale_dtype="torch.uint8"),
              dict(_FP8_ACTIVATIONS, strategy="group", group_size=32, scale_dtype="torch.uint8")),
    "int8_wo": (PACK_QUANTIZED, dict(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False), None),
    "int4_wo": (PACK_QUANTIZED, dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=128,
                                     dynamic=False), None),
    "int4_sym_wo": (PACK_QUANTIZED, dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128,
                                         dynamic=False), None),
    "mxfp4_wo": (MXFP4_PACKED, dict(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32,
                                    dynamic=False, scale_dtype="torch.uint8"), None),
    "nvfp4_wo": (NVFP4_PACKED, dict(num_bits=4, type="float", symmetric=True, strategy="tensor_group", group_size=16,
                                    dynamic=False, scale_dtype="torch.float8_e4m3fn"), None),
}


def group_config(recipe: str, targets: list[str]) -> dict:
    """One config_groups entry of quantization_config."""
    if recipe not in SCHEMES:
        raise ValueError(f"fxquant: recipe {recipe!r} has no compressed-tensors scheme here; checkpoints are written "
                         f"for {', '.join(SCHEMES)}")
    fmt, weights, activations = SCHEMES[recipe]
    return {"targets": targets, "weights": weights, "input_activations": activations, "format": fmt}


def recipe_of(group: dict, where: str) -> str:
    """The recipe that computes what a config_groups entry describes; a clear error where none does."""
    weights, activations = group.get("weights") or {}, group.get("input_activations")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    recipe = None
    if kind == "float" and bits == 8 and activations and activations.get("dynamic") is True:
        act = activations.get("strategy"), activations.get("group_size")
        if strategy == "channel" and act[0] == "token":
            recipe = "fp8_row"
        elif strategy == "block" and list(weights.get("block_structure") or []) == [128, 128] and act == ("group", 128):
            recipe = "fp8_block"
        elif strategy == "tensor" and act[0] == "tensor":
            recipe = "fp8_tensor"
        elif strategy == "group" and weights.get("group_size") == 32 and act == ("group", 32) and _e8m0(weights):
            recipe = "mxfp8"
    elif (kind == "float" and bits == 4 and strategy == "group" and weights.get("group_size") == 32
          and activations is None):
        recipe = "mxfp4_wo"
    elif (kind == "float" and bits == 4 and strategy == "tensor_group" and weights.get("group_size") == 16
          and activations is None):
        recipe = "nvfp4_wo"
    elif kind == "int" and activations is None and weights.get("actorder") in (None, "none"):
        if bits == 8 and strategy == "channel" and weights.get("symmetric", True):
            recipe = "int8_wo"
        elif bits == 4 and strategy == "group" and weights.get("group_size") == 128:
            recipe = "int4_sym_wo" if weights.get("symmetric", True) else "int4_wo"
    if recipe is None:
        raise NotImplementedError(
            f"fxquant: {where}: no fxquant recipe computes this compressed-tensors scheme (weights {weights}, "
            f"input_activations {activations}); loadable: fp8 per channel / 128x128 block / per tensor and MXFP8 with "
            "dynamic activations; int8 per channel, int4 in groups of 128, MXFP4 and NVFP4, weight-only")
    return recipe


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
    if SCHEMES[recipe][0] == FLOAT_QUANTIZED:
        return {"weight": layer.weight.detach(), "weight_scale": scale.reshape(1) if scale.dim() == 0 else scale}
    if recipe in ("mxfp4_wo", "mxfp8"):
        key = "weight_packed" if recipe == "mxfp4_wo" else "weight"
        return {key: layer.weight.detach(), "weight_scale": layer.weight_scale.detach().view(torch.uint8)}
    if recipe == "nvfp4_wo":
        return {"weight_packed": layer.weight.detach(), "weight_scale": layer.weight_scale.detach(),
                "weight_global_scale": (1.0 / layer.weight_global_scale.detach().float()).reshape(1)}
    tensors = {"weight_scale": scale, "weight_shape": torch.tensor([n, k])}
    if recipe == "int8_wo":
        tensors["weight_packed"] = _pack_rows(_offset_binary(layer.weight.detach().view(torch.uint8)))
    elif recipe == "int4_sym_wo":
        tensors["weight_packed"] = _pack_rows(layer.weight.detach() ^ NIBBLE_SIGN_BITS)
    else:
        tensors["weight_packed"] = _pack_rows(layer.weight.detach())
        tensors["weight_zero_point"] = _nibbles_down(layer.weight_zero_point.detach())
    return tensors


def stored_names(recipe: str) -> tuple[str, ...]:
    """The tensors of a layer that loading needs (int4's zero point is not among them: symmetric checkpoints have
    none)."""
    fmt = SCHEMES[recipe][0]
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
    if recipe in ("mxfp4_wo", "mxfp8"):
        exponents = tensors["weight_scale"]
        if exponents.dtype != torch.uint8:
            raise ValueError(f"fxquant: {recipe} weight_scale is {exponents.dtype}, expected uint8 E8M0 exponents")
        codes = tensors["weight_packed" if recipe == "mxfp4_wo" else "weight"]
        if recipe == "mxfp8" and codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fxquant: mxfp8 weight is {codes.dtype}, expected float8_e4m3fn")
        return {"weight": codes, "weight_scale": exponents.view(torch.float8_e8m0fnu)}
    if recipe == "nvfp4_wo":
        block_scale = tensors["weight_scale"]
        if block_scale.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fxquant: nvfp4 weight_scale is {block_scale.dtype}, expected float8_e4m3fn")
        global_scale = (1.0 / tensors["weight_global_scale"].float()).reshape(())  # fxquant multiplies by it
        return {"weight": tensors["weight_packed"], "weight_scale": block_scale, "weight_global_scale": global_scale}
    scale = tensors["weight_scale"].float()
    if SCHEMES[recipe][0] == FLOAT_QUANTIZED:
        codes = tensors["weight"]
        if codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"fxquant: float-quantized weight is {codes.dtype}, expected float8_e4m3fn")
        return {"weight": codes, "weight_scale": scale.reshape(()) if recipe == "fp8_tensor" else scale}
    packed = tensors["weight_packed"].contiguous().view(torch.uint8)
    if recipe == "int8_wo":  # in place: the layer's codes are the stored bytes, never a second copy of the layer
        return {"weight": packed.bitwise_xor_(SIGN_BIT).view(torch.int8), "weight_scale": scale}
    if recipe == "int4_sym_wo":
        return {"weight": packed.bitwise_xor_(NIBBLE_SIGN_BITS), "weight_scale": scale}
    zero_point = tensors.get("weight_zero_point")
    zero_point = (_unnibble_down(zero_point, out_features) if zero_point is not None
                  else torch.full(scale.shape, 8, dtype=torch.uint8, device=scale.device))  # none stored: q - 8
    return {"weight": packed, "weight_scale": scale, "weight_zero_point": zero_point}
