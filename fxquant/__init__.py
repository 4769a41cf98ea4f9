"""fxquant: low-precision quantization as torch.fx passes behind torch.compile."""

from fxquant.api import dequantize, quantize
from fxquant.backend import fxquant as backend
from fxquant.config import RECIPES, QuantConfig, from_options
from fxquant.export import export, load
from fxquant.formats import FORMATS, FloatFormat, IntFormat
from fxquant.granularity import Granularity
from fxquant.inspection import InspectReport, inspect
from fxquant.quantized import Quantized

__all__ = [
    "FORMATS", "RECIPES", "FloatFormat", "Granularity", "InspectReport", "IntFormat", "QuantConfig", "Quantized",
    "backend", "dequantize", "export", "from_options", "inspect", "load", "quantize",
]
