"""fxquant: low-precision quantization as torch.fx passes behind torch.compile."""

from fxquant.api import dequantize, quantize
from fxquant.compile.backend import fxquant as backend
from fxquant.compile.inspection import InspectReport, inspect
from fxquant.compile.lint import NumericsError
from fxquant.config import RECIPES, QuantConfig, from_options
from fxquant.io.checkpoint import load_quantized, save_quantized
from fxquant.io.export import export, load, package
from fxquant.kernels.dependent_launch import dependent_launches
from fxquant.modules.inplace import quantize_
from fxquant.modules.quantized_experts import QuantizedExperts
from fxquant.modules.quantized_linear import QuantizedLinear
from fxquant.modules.skeleton import empty_weights
from fxquant.numerics.formats import FORMATS, FloatFormat, IntFormat
from fxquant.numerics.granularity import Granularity
from fxquant.numerics.quantized import Quantized

__all__ = [
    "FORMATS", "FP8StaticCache", "RECIPES", "FloatFormat", "Granularity", "InspectReport", "IntFormat", "NumericsError",
    "QuantConfig", "Quantized", "QuantizedExperts", "QuantizedLinear", "backend", "dependent_launches", "dequantize",
    "empty_weights", "export", "from_options", "generate", "inspect", "kv_scales_of", "load", "load_quantized",
    "package", "quantize", "quantize_", "save_quantized",
]


def __getattr__(name: str):
    # They use transformers: it is imported on their first use, never by `import fxquant`.
    if name == "FP8StaticCache":
        from fxquant.modules.kv_cache import FP8StaticCache

        return FP8StaticCache
    if name == "kv_scales_of":
        from fxquant.io.kv_scales import kv_scales_of

        return kv_scales_of
    if name == "generate":
        from fxquant.generation import generate

        return generate
    raise AttributeError(f"module 'fxquant' has no attribute {name!r}")
