"""The public numerics API: `quantize` and `dequantize`, on the reference or on the Triton kernels."""

from __future__ import annotations

import torch

from fxquant.numerics import reference
from fxquant.numerics.granularity import Granularity, as_granularity
from fxquant.numerics.quantized import Quantized

IMPLS = ("auto", "reference", "triton")
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def quantize(x: torch.Tensor, fmt: str, granularity=None, *, scale=None, scale_mode=None, symmetric=False,
             impl: str = "auto") -> Quantized:
    """Quantize `x` to `fmt` with one scale per `granularity` block.

    fmt:         "fp8_e4m3", "fp8_e5m2", "int8", "int4", "mxfp8", "mxfp4" or "nvfp4"
    granularity: "tensor", "token", "channel", ("group", g) or ("block", bn, bk); None takes the format's
                 default ("tensor"; int4 groups of 128; MX and NVFP4 fix blocks of 32 and 16)
    scale:       a static (calibrated) fp32 scale for fp8 / int8, or NVFP4's global scale; None computes it from
                 the data
    scale_mode:  MX: "floor", "even" (mxfp4 default), "ceil" or "rceil"; int4: None (each group's amax scale),
                 "searched" (the amax scale times the factor, 1 down to 0.65, whose codes err least: the int4
                 weight-only recipes'), or, symmetric, "row_powers_of_two" (each group scale a power of
                 two times its row's: W4A8 multiplies such codes row-scaled)
    symmetric:   int4 only: codes -7..7 and no zero point, instead of 0..15 with one
    impl:        "reference" (pure torch), "triton" (the kernel; on the CPU under TRITON_INTERPRET=1) or
                 "auto" (the kernel on CUDA where one exists, else the reference)
    """
    if impl not in IMPLS:
        raise ValueError(f"fxquant: unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
    wants_kernel = impl == "triton" or (impl == "auto" and x.is_cuda)
    kernel = _triton_quantize(x, fmt, granularity, scale) if wants_kernel else None
    if impl == "triton" or kernel is not None:
        if kernel is None:
            raise NotImplementedError(
                f"fxquant: no Triton quantize kernel for {fmt} with granularity {granularity!r}; kernels exist "
                "for fp8 'token', ('group', g <= 16384) and 'tensor' scales; use impl='reference'"
            )
        return kernel()
    return reference.quantize(x, fmt, granularity, scale=scale, scale_mode=scale_mode, symmetric=symmetric)


def dequantize(q: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values of `q` in `dtype` (default: the dtype that was quantized)."""
    return reference.dequantize(q, dtype)


def _triton_quantize(x, fmt, granularity, scale):
    """A thunk running the Triton kernel for this request, or None where no kernel serves it."""
    from fxquant.kernels.quant_fp8 import MAX_ROW_LEN, quantize_fp8_rows, quantize_fp8_static, quantize_fp8_tensor

    if fmt not in FP8_DTYPES:
        return None
    gran = reference.default_granularity(fmt) if granularity is None else as_granularity(granularity)
    gran.scale_shape(x.shape)  # shape errors first, whatever the impl
    fp8 = FP8_DTYPES[fmt]
    meta = dict(fmt=fmt, granularity=gran, shape=x.shape, dtype=x.dtype)
    if gran.kind == "token" and scale is None and x.shape[-1] <= MAX_ROW_LEN:
        return lambda: Quantized(*quantize_fp8_rows(x, x.shape[-1], fp8), **meta)
    if gran.kind == "group" and scale is None and gran.sizes[0] <= MAX_ROW_LEN:
        return lambda: Quantized(*quantize_fp8_rows(x, gran.sizes[0], fp8), **meta)
    if gran == Granularity("tensor"):
        if scale is None:
            return lambda: Quantized(*quantize_fp8_tensor(x, fp8), **meta)
        s = torch.as_tensor(scale, dtype=torch.float32, device=x.device).reshape(())
        return lambda: Quantized(quantize_fp8_static(x, s, fp8), s, **meta)
    return None
