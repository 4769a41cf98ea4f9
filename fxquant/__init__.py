"""fxquant: low-precision quantization as torch.fx passes behind torch.compile."""

from fxquant.api import dequantize, quantize
from fxquant.backend import fxquant as backend
from fxquant.checkpoint import load_quantized, save_quantized
from fxquant.config import RECIPES, QuantConfig, from_options
from fxquant.export import export, load, package
from fxquant.formats import FORMATS, FloatFormat, IntFormat
from fxquant.granularity import Granularity
from fxquant.inplace import quantize_
from fxquant.inspection import InspectReport, inspect
from fxquant.lint import NumericsError
from fxquant.quantized import Quantized
from fxquant.quantized_experts import QuantizedExperts
from fxquant.quantized_linear import QuantizedLinear
from fxquant.skeleton import empty_weights

__all__ = [
    "FORMATS", "FP8StaticCache", "RECIPES", "FloatFormat", "Granularity", "InspectReport", "IntFormat", "NumericsError",
    "QuantConfig", "Quantized", "QuantizedExperts", "QuantizedLinear", "backend", "dequantize", "empty_weights",
    "export", "from_options", "generate", "inspect", "kv_scales_of", "load", "load_quantized", "package", "quantize",
    "quantize_", "save_quantized",
]


def __getattr__(name: str):
    # They use transformers: it is imported on their first use, never by `import fxquant`.
    if name in ("FP8StaticCache", "kv_scales_of"):
        from fxquant import kv_cache

        return getattr(kv_cache, name)
    if name == "generate":
        from fxquant.generation import generate

        return generate
    raise AttributeError(f"module 'fxquant' has no attribute {name!r}")
