"""`Quantized`: a quantized tensor's codes and scales, as returned by `fxquant.quantize`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from fxquant.numerics.granularity import Granularity


@dataclass(frozen=True)
class Quantized:
    """Codes plus everything needed to dequantize them.

    data:         float8_e4m3fn / float8_e5m2 / int8 codes in the input's shape, or uint8 with two 4-bit
                  codes per byte (low nibble first) and the last dim halved (int4, mxfp4, nvfp4)
    scale:        fp32 with `granularity.scale_shape(shape)`; float8_e8m0fnu for MX; float8_e4m3fn block
                  scales for NVFP4
    global_scale: NVFP4's fp32 per-tensor scale, else None
    zero_point:   asymmetric int4's uint8 zero points (scale's shape), else None
    scale_mode:   how MX's exponents were rounded; for int4, "row_powers_of_two" where each group scale is a power
                  of two times its row's (numerics/row_powers_of_two.py)
    row_scale:    that row scale, fp32 [..., N, 1], else None: W4A8's row-scaled GEMMs read it
    """

    data: torch.Tensor
    scale: torch.Tensor
    fmt: str
    granularity: Granularity
    shape: torch.Size
    dtype: torch.dtype
    global_scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    scale_mode: str | None = None
    row_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        extra = [t for t in (self.global_scale, self.zero_point, self.row_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, *extra))

    def rows(self, start: int, stop: int) -> Quantized:
        """Rows start:stop of a quantized [N, K] tensor as a Quantized of their own: their codes and the scales that
        cover them (start a multiple of the rows one scale covers, 128 for 128x128 blocks; a per-tensor scale is
        every row's). Dequantizing a weight a part at a time holds that part's temporaries, not the whole's."""
        n = self.shape[0]

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dim() == 0:
                return t
            per = n // t.shape[0]  # rows each of t's rows covers: 1, a block's rows, or all of them
            return t[start // per:-(-stop // per)]

        return replace(self, data=self.data[start:stop], scale=part(self.scale), zero_point=part(self.zero_point),
                       row_scale=part(self.row_scale), shape=torch.Size((stop - start, *self.shape[1:])))
