"""Every op the passes insert, as a `torch.library` op `fxquant::...` with a fake impl, one module per family:
`linear`, `experts`, `attention`, `norm`; `declare` holds how an op is declared, `reference_gemm` the fallback GEMM.

Dynamo, Inductor and torch.export see through these ops. CPU tensors run the pure-torch reference;
CUDA tensors run the Triton kernels where one serves the case, else the same reference on the GPU.

The ops are defined with `torch.library.define` and `torch.library.impl` rather than the `custom_op` decorator,
whose Python autograd and checking wrappers cost 10-18 us of host time per call on the H200's host against 1-4 us
this way (docs/decisions/0001-library-ops-over-custom-op.md): without CUDA graphs a
decode step is host-bound. The ops are for inference and have no autograd formula. With grad mode on, the backend
refuses, with the fix, a graph whose inputs require grad; called directly, an op lets torch's fallback differentiate
through the reference, and torch warns.
"""

from fxquant.ops.attention import (
                                    decode_attention,
                                    decode_attention_quantize_fp8,
                                    dequantize_kv,
                                    rotary_cache_append,
                                    rotary_cache_append_e4m3,
                                    rotary_cache_write,
                                    rotary_cache_write_e4m3,
)
from fxquant.ops.experts import (
                                 grouped_linear_mxfp8,
                                 grouped_linear_weight_only,
                                 grouped_scaled_mm_fp8,
                                 grouped_scaled_mm_int4_fp8,
                                 sort_by_expert,
                                 uniform_offsets,
)
from fxquant.ops.linear import (
                                 linear_fp4_lanes,
                                 linear_fp8,
                                 linear_int4_lanes,
                                 linear_mxfp8,
                                 linear_weight_only,
                                 quantize_fp8,
                                 scaled_mm_fp8,
                                 scaled_mm_int4_fp8_lanes,
)
from fxquant.ops.norm import add_norm_quant_fp8, norm_quant_fp8
from fxquant.ops.reference_gemm import CHUNK_ROWS

__all__ = ["CHUNK_ROWS", "add_norm_quant_fp8", "decode_attention", "decode_attention_quantize_fp8", "dequantize_kv",
           "grouped_linear_mxfp8", "grouped_linear_weight_only", "grouped_scaled_mm_fp8",
           "grouped_scaled_mm_int4_fp8", "linear_fp4_lanes", "linear_fp8",
           "linear_int4_lanes", "linear_mxfp8", "linear_weight_only", "norm_quant_fp8", "quantize_fp8",
           "rotary_cache_append", "rotary_cache_append_e4m3", "rotary_cache_write", "rotary_cache_write_e4m3",
           "scaled_mm_fp8", "scaled_mm_int4_fp8_lanes", "sort_by_expert",
           "uniform_offsets"]
