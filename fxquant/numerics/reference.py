"""The oracle: pure-torch quantize / dequantize for every format and granularity, and the scaled GEMM.

Every kernel is tested against these functions. All math is fp32 and follows the numerics policies the README
states:
- scale = max(amax, AMAX_FLOOR) / format max, so an all-zero block gives zeros, never NaN;
- finite values saturate to +-max before the narrowing cast: no wrap, no inf;
- a block holding NaN or inf gets a NaN scale, so its dequantized values are NaN (never laundered);
- rounding is round-to-nearest-even everywhere, subnormals included.
"""

from __future__ import annotations

import torch

from fxquant.numerics.formats import AMAX_FLOOR, E2M1, E4M3, E5M2, E8M0, INT8, FloatFormat, apply_scale, fdiv
from fxquant.numerics.granularity import Granularity, as_granularity
from fxquant.numerics.int4 import SEARCHED, quantize_groups, symmetric_codes
from fxquant.numerics.minifloat import decode, encode, pack_nibbles, round_to_format, unpack_nibbles
from fxquant.numerics.quantized import Quantized
from fxquant.numerics.row_powers_of_two import SCALE_MODE as ROW_POWERS_OF_TWO
from fxquant.numerics.row_powers_of_two import group_scales as row_power_of_two_scales

FP8 = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2}
MX = {"mxfp8": E4M3, "mxfp4": E2M1}
FORMAT_NAMES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4", "mxfp8", "mxfp4", "nvfp4")
MX_BLOCK, NVFP4_BLOCK, INT4_GROUP = 32, 16, 128
SCALE_MODES = ("floor", "even", "ceil", "rceil")
DEFAULT_SCALE_MODE = {"mxfp4": "even", "mxfp8": "floor"}


def default_granularity(fmt: str) -> Granularity:
    fixed = {"mxfp8": MX_BLOCK, "mxfp4": MX_BLOCK, "nvfp4": NVFP4_BLOCK, "int4": INT4_GROUP}
    return Granularity("group", (fixed[fmt],)) if fmt in fixed else Granularity("tensor")


def block_amax(xb: torch.Tensor) -> torch.Tensor:
    """amax over the last dim; a block holding NaN or inf gets NaN, which poisons its scale."""
    if xb.shape[-1] == 0:
        return xb.new_zeros(xb.shape[:-1])
    amax = xb.abs().amax(-1)
    return torch.where(torch.isfinite(amax), amax, torch.nan)


def scale_from_amax(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    # The floor keeps all-zero blocks at scale > 0 (zeros out, not 0/0); clamp_min keeps NaN.
    return fdiv(amax.clamp_min(AMAX_FLOOR), fmax)


def saturate(q: torch.Tensor, x: torch.Tensor, fmax: float) -> torch.Tensor:
    """Clamp finite values to +-fmax; a non-finite input element becomes NaN (inf never saturates to max)."""
    return torch.where(torch.isfinite(x), q.clamp(-fmax, fmax), torch.nan)


def quantize(x, fmt, granularity=None, *, scale=None, scale_mode=None, symmetric=False) -> Quantized:
    if fmt not in FORMAT_NAMES:
        raise ValueError(f"fxquant: unknown format {fmt!r}; valid: {', '.join(FORMAT_NAMES)}")
    gran = _resolve_granularity(fmt, granularity)
    if scale is not None and fmt not in ("fp8_e4m3", "fp8_e5m2", "int8", "nvfp4"):
        raise ValueError(f"fxquant: a static scale is supported for fp8_e4m3, fp8_e5m2, int8 and nvfp4 (its global "
                         f"scale), not {fmt}")
    if scale_mode is not None and fmt not in MX and (fmt, scale_mode) != ("int4", SEARCHED) and (
            (fmt, scale_mode, symmetric) != ("int4", ROW_POWERS_OF_TWO, True)):
        raise ValueError(f"fxquant: scale_mode applies to mxfp8 / mxfp4, {SEARCHED!r} to int4 and "
                         f"{ROW_POWERS_OF_TWO!r} to symmetric int4; not {scale_mode!r} to "
                         f"{fmt}{' symmetric' if symmetric else ''}")
    if symmetric and fmt != "int4":
        raise ValueError("fxquant: symmetric= selects between int4's two schemes; other formats are symmetric")
    xb = gran.to_blocks(x.float())  # quantization math is fp32 whatever the input dtype
    meta = dict(fmt=fmt, granularity=gran, shape=x.shape, dtype=x.dtype)
    if fmt in FP8:
        data, s = _quantize_scaled(xb, FP8[fmt], gran, scale)
        return Quantized(gran.from_blocks(data, x.shape), s, **meta)
    if fmt == "int8":
        data, s = _quantize_scaled(xb, INT8, gran, scale)
        return Quantized(gran.from_blocks(data, x.shape), s, **meta)
    if fmt == "int4" and scale_mode == ROW_POWERS_OF_TWO:
        s, row = row_power_of_two_scales(xb)
        codes = symmetric_codes(xb, s) & 0xF  # two's complement nibbles
        return Quantized(pack_nibbles(gran.from_blocks(codes, x.shape)), s, scale_mode=scale_mode, row_scale=row,
                         **meta)
    if fmt == "int4":
        codes, s, zp = quantize_groups(xb, symmetric, searched=scale_mode == SEARCHED)
        zp = None if zp is None else zp.to(torch.uint8)
        # how the scales were searched is not kept: every reader takes the codes and scales as they are
        return Quantized(pack_nibbles(gran.from_blocks(codes & 0xF, x.shape)), s, zero_point=zp, **meta)
    if fmt in MX:
        mode = scale_mode or DEFAULT_SCALE_MODE[fmt]
        if mode not in SCALE_MODES:
            raise ValueError(f"fxquant: unknown scale_mode {mode!r}; valid: {', '.join(SCALE_MODES)}")
        data, s = _quantize_mx(xb, MX[fmt], mode)
        data = gran.from_blocks(data, x.shape)
        return Quantized(pack_nibbles(data) if fmt == "mxfp4" else data, s, scale_mode=mode, **meta)
    codes, s, gs = _quantize_nvfp4(xb, scale)
    return Quantized(pack_nibbles(gran.from_blocks(codes, x.shape)), s, global_scale=gs, **meta)


def dequantize(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    gran = q.granularity
    if q.fmt == "int4":
        codes = unpack_nibbles(q.data).to(torch.int32)
        values = codes.float() if q.zero_point is not None else ((codes ^ 8) - 8).float()  # sign-extend
    elif q.fmt in ("mxfp4", "nvfp4"):
        values = decode(unpack_nibbles(q.data), E2M1)
    else:
        values = q.data.float()
    vb = gran.to_blocks(values)
    if q.zero_point is not None:
        vb = vb - q.zero_point.float()[..., None]
    scale = q.scale.float()
    if q.global_scale is not None:
        scale = scale * q.global_scale
    return gran.from_blocks(vb * scale[..., None], q.shape).to(dtype or q.dtype)


def scaled_mm(a: Quantized, b: Quantized, *, bias=None, out_dtype=None) -> torch.Tensor:
    """out = dequant(a) @ dequant(b).T (+ bias) in fp32, cast once. a: [..., K] activations; b: [N, K] weight."""
    if a.shape[-1] != b.shape[-1] or len(b.shape) != 2:
        raise ValueError(f"fxquant: scaled_mm needs a [..., K] and b [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    out = dequantize(a, torch.float32) @ dequantize(b, torch.float32).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or a.dtype)


def quantize_experts(w: torch.Tensor, fmt: str, granularity=None, **kwargs) -> Quantized:
    """Expert weights [E, N, K], each expert quantized on its own and the results stacked along a leading expert
    dim: no scale spans two experts, and NVFP4's global scale (global_scale [E]) is per expert, as each expert is
    a linear layer of its own."""
    return stack_experts([quantize(w[e], fmt, granularity, **kwargs) for e in range(w.shape[0])])


def stack_experts(parts: list[Quantized]) -> Quantized:
    """The experts' 2-D Quantized weights as one, every tensor field stacked along a new leading dim."""
    first = parts[0]
    stacked = lambda field: None if getattr(first, field) is None else torch.stack([getattr(p, field) for p in parts])
    return Quantized(stacked("data"), stacked("scale"), first.fmt, first.granularity,
                     torch.Size((len(parts), *first.shape)), first.dtype, global_scale=stacked("global_scale"),
                     zero_point=stacked("zero_point"), scale_mode=first.scale_mode, row_scale=stacked("row_scale"))


def expert(q: Quantized, e: int) -> Quantized:
    """Expert e's 2-D Quantized weight from stacked experts."""
    pick = lambda t: None if t is None else t[e]
    return Quantized(q.data[e], q.scale[e], q.fmt, q.granularity, q.shape[1:], q.dtype,
                     global_scale=pick(q.global_scale), zero_point=pick(q.zero_point), scale_mode=q.scale_mode,
                     row_scale=pick(q.row_scale))


def dequantize_experts(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stacked experts [E, N, K], each expert dequantized with its own scales."""
    return torch.stack([dequantize(expert(q, e), dtype) for e in range(q.shape[0])])


def expert_rows(offs: torch.Tensor):
    """(expert, its rows as a slice) for each expert with rows, rows sorted by expert with cumulative ends `offs`
    (the grouped_mm contract). One host sync."""
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            yield e, slice(start, end)
        start = end


def grouped_linear(x: torch.Tensor, offs: torch.Tensor, w: Quantized, out_dtype=None) -> torch.Tensor:
    """The grouped GEMM over rows sorted by expert: out[r] = x[r] @ dequantize(w[e]).T for expert e's rows
    [offs[e-1], offs[e]) (cumulative ends, the grouped_mm contract), in fp32 with one cast; rows past offs[-1]
    belong to no expert and are zero. x: [M, K], already the values the GEMM multiplies (dequantized
    activations)."""
    out = torch.zeros((x.shape[0], w.shape[1]), dtype=torch.float32, device=x.device)
    for e, rows in expert_rows(offs):
        out[rows] = x[rows].float() @ dequantize(expert(w, e), torch.float32).T
    return out.to(out_dtype or x.dtype)


def mx_scale_exponent(amax: torch.Tensor, elem: FloatFormat, mode: str) -> torch.Tensor:
    """Unbiased E8M0 exponent (int32, clamped to [-127, 127]) of a block's fp32 amax; NaN handled by the caller."""
    bits = amax.view(torch.int32)
    biased, mant = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if mode == "floor":  # strict OCP: floor(log2(amax)) - emax_elem; may clip the top of the block
        e = biased - 127 - elem.emax
    elif mode == "even":  # round amax to the element's mantissa width first (at 0.75 for e2m1), then floor
        rounded = bits + (1 << (22 - elem.mbits))
        e = ((rounded >> 23) & 0xFF) - 127 - elem.emax
    elif mode == "ceil":  # the smallest scale that never clips: bump when amax's significand > max's
        max_frac = int((elem.max_mantissa - 1) * 2**23)
        e = biased - 127 - elem.emax + (mant > max_frac).to(torch.int32)
    else:  # rceil: amax / max in fp32, rounded up to a power of two (cvt.rp.satfinite.ue8m0)
        qbits = fdiv(amax, elem.max).view(torch.int32)
        qb, qm = (qbits >> 23) & 0xFF, qbits & 0x7FFFFF
        e = torch.where(qb == 0, torch.where(qm > 0x400000, -126, -127), qb - 127 + (qm != 0).to(torch.int32))
    return e.clamp(-127, 127)  # E8M0's range: a tiny block gets 2**-127, never a zero scale


def _resolve_granularity(fmt: str, granularity) -> Granularity:
    default = default_granularity(fmt)
    if granularity is None:
        return default
    gran = as_granularity(granularity)
    if fmt in ("mxfp8", "mxfp4", "nvfp4") and gran != default:
        raise ValueError(f"fxquant: {fmt} fixes its own blocks ({default}); pass granularity=None")
    return gran


def _quantize_scaled(xb, fmt, gran, static_scale):
    """fp8 and int8: one fp32 scale per block, symmetric."""
    scale_shape = xb.shape[:-1]
    if static_scale is None:
        scale = scale_from_amax(block_amax(xb), fmt.max)
    else:
        scale = torch.as_tensor(static_scale, dtype=torch.float32, device=xb.device).expand(scale_shape).clone()
        if not (torch.isfinite(scale) & (scale > 0)).all():
            raise ValueError("fxquant: a static scale must be finite and > 0; calibrate it, or pass scale=None")
    q = saturate(apply_scale(xb, scale), xb, fmt.max)
    if fmt is INT8:
        # Round half to even; a NaN element stores 0 (int8 has no NaN): its NaN scale carries the poison.
        q = torch.round(q).nan_to_num(0.0)
    return q.to(fmt.torch_dtype), scale


def _quantize_mx(xb, elem, mode):
    amax = block_amax(xb)
    e = mx_scale_exponent(amax, elem, mode)
    code = torch.where(torch.isnan(amax), 0xFF, e + 127).to(torch.uint8)  # 0xFF is E8M0's NaN
    scale = code.view(E8M0.torch_dtype)
    q = saturate(apply_scale(xb, scale.float()), xb, elem.max)  # powers of two: exact
    if elem is E4M3:
        return q.to(E4M3.torch_dtype), scale
    # e2m1 has no NaN code: a poisoned block stores 0 and its NaN scale carries the poison.
    return encode(round_to_format(q, E2M1).nan_to_num(0.0), E2M1), scale


def nvfp4_global_amax(x: torch.Tensor) -> torch.Tensor:
    """The amax NVFP4's global scale comes from: over finite values only, so NaN poisons its own block only."""
    finite = torch.where(torch.isfinite(x), x.float().abs(), 0.0)
    return finite.amax() if x.numel() else finite.new_zeros(())


def _quantize_nvfp4(xb, static_global=None):
    """Two-level: fp32 global scale = amax / (448 * 6) (or a static one), e4m3 block scales, e2m1 codes."""
    if static_global is None:
        global_scale = scale_from_amax(nvfp4_global_amax(xb), E4M3.max * E2M1.max)
    else:
        global_scale = torch.as_tensor(static_global, dtype=torch.float32, device=xb.device).reshape(())
        if not (torch.isfinite(global_scale) & (global_scale > 0)):
            raise ValueError("fxquant: a static NVFP4 global scale must be finite and > 0; pass scale=None")
    block_scale = fdiv(block_amax(xb), E2M1.max) / global_scale
    # Floor at e4m3's smallest subnormal: zero blocks give zeros and tiny blocks keep their values.
    block_scale = block_scale.clamp(E4M3.min_subnormal, E4M3.max).to(E4M3.torch_dtype)
    q = saturate(apply_scale(xb, block_scale.float() * global_scale), xb, E2M1.max)
    return encode(round_to_format(q, E2M1).nan_to_num(0.0), E2M1), block_scale, global_scale
