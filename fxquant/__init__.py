"""fxquant: low-precision quantization as torch.fx passes behind torch.compile."""

from fxquant.api import dequantize, quantize
from fxquant.formats import FORMATS, FloatFormat, IntFormat
from fxquant.granularity import Granularity
from fxquant.quantized import Quantized

__all__ = ["FORMATS", "FloatFormat", "Granularity", "IntFormat", "Quantized", "dequantize", "quantize"]
