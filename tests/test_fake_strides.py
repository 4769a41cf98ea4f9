"""Each fxquant op's fake (what Inductor plans its buffers by) gives the real outputs' sizes, dtypes and strides, also
for inputs in a transposed layout: transformers hands the KV cache [B, H, S, D] views of [B, S, H, D] projections.
Inductor asserts the strides it planned, so a fake that keeps an input's layout while the kernel writes a contiguous
output stops a compiled prefill on the GPU (an FP8 cache's prefill of 4096 tokens did). On the CPU the ops run their
references, and the kernels that allocate outputs run under Triton's interpreter to be compared too (the fault the
GPU found in decode attention, an output laid out as `empty_like(q)`, showed only there while the reference copied
into the fake's layout); the GPU suite runs the ops' own cases on the kernels."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels import decode_attention as attention_kernels
from fxquant.kernels import silu_mul_quant
from fxquant.kernels.gemm_fp4_mma import pack_fp4_lanes
from fxquant.kernels.gemm_int4_mma import pack_lanes
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
from fxquant.kernels.rotary_cache import rotary_cache_write
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPS = torch.ops.fxquant


def transposed(*shape, dtype=torch.bfloat16):
    """A [B, H, S, D] view of a contiguous [B, S, H, D] tensor, as attention's q, k, v."""
    b, h, s, d = shape
    return torch.randn(b, s, h, d, device=DEVICE).to(dtype).transpose(1, 2)


def cases():
    x, gate, up = transposed(1, 2, 6, 128), transposed(1, 2, 6, 128), transposed(1, 2, 6, 128)
    weight = torch.randn(128, device=DEVICE).to(torch.bfloat16)
    q, k, v = transposed(1, 8, 1, 64), transposed(1, 2, 16, 64), transposed(1, 2, 16, 64)
    q_bhqd = torch.randn(1, 8, 1, 64, device=DEVICE).to(torch.bfloat16)
    codes = transposed(1, 2, 16, 64).to(torch.float8_e4m3fn)
    cos, sin = (torch.randn(1, 2, 64, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    caches = [torch.zeros(1, 2, 16, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
    rows = torch.randn(6, 2, 128, device=DEVICE).to(torch.bfloat16).transpose(0, 1)  # [2, 6, 128], not contiguous
    w8 = R.quantize(torch.randn(64, 128, device=DEVICE) * 0.05, "fp8_e4m3", "channel")
    w4 = R.quantize(torch.randn(64, 128, device=DEVICE) * 0.05, "int4", ("group", 128))
    nv = R.quantize(torch.randn(64, 128, device=DEVICE) * 0.05, "nvfp4")
    qa = R.quantize(torch.randn(1, 1, 128, device=DEVICE), "fp8_e4m3", "token")  # one row of e4m3 codes
    return {
        "rotary_cache_write": (OPS.rotary_cache_write, (transposed(1, 8, 2, 64), transposed(1, 2, 2, 64),
                                                        transposed(1, 2, 2, 64), cos, sin,
                                                        torch.tensor([3, 4], device=DEVICE), *caches)),
        "linear_fp8": (OPS.linear_fp8, (rows, w8.data, w8.scale, None, 0)),
        "linear_weight_only": (OPS.linear_weight_only, (rows, w4.data, w4.scale, None, w4.zero_point, None, "int4",
                                                        128, 64)),
        "linear_fp4_lanes": (OPS.linear_fp4_lanes, (rows, nv.data, nv.scale, nv.global_scale,
                                                    pack_fp4_lanes(nv.scale, "nvfp4"), None, "nvfp4", 16, 64)),
        "linear_fp4_lanes, one row": (OPS.linear_fp4_lanes, (rows[:1, :1], nv.data, nv.scale, nv.global_scale,
                                                             pack_fp4_lanes(nv.scale, "nvfp4"), None, "nvfp4", 16,
                                                             64)),
        "scaled_mm_int4_fp8_lanes, one row": (OPS.scaled_mm_int4_fp8_lanes, (
            qa.data, qa.scale, w4.data, w4.scale, w4.zero_point, *pack_lanes(w4.scale, w4.zero_point), None, 128, 64,
            torch.bfloat16)),
        "quantize_fp8 per token": (OPS.quantize_fp8, (x, 0)),
        "quantize_fp8 1x64": (OPS.quantize_fp8, (x, 64)),
        "quantize_fp8 per tensor": (OPS.quantize_fp8, (x, -1)),
        "silu_mul_quantize_fp8": (OPS.silu_mul_quantize_fp8, (gate, up, 0)),
        "norm_quant_fp8": (OPS.norm_quant_fp8, (x, weight, None, 1e-6, 0, True)),
        "add_norm_quant_fp8": (OPS.add_norm_quant_fp8, (x, up, weight, None, 1e-6, 0, True)),
        "decode_attention": (OPS.decode_attention, (q, k, v, None, 0.125, 0.0, None, None, None, None)),
        # q made [B, Hq, Q, D]: the output's stride along its dim of size 1 (the query) still follows [B, Q, Hq, D]
        "decode_attention, q made [B, Hq, Q, D]": (OPS.decode_attention, (q_bhqd, k, v, None, 0.125, 0.0, None, None,
                                                                         None, None)),
        "decode_attention_quantize_fp8": (OPS.decode_attention_quantize_fp8,
                                          (q, k, v, None, 0.125, 0.0, None, None, None, None, 0)),
        "dequantize_kv": (OPS.dequantize_kv, (codes, torch.ones(1, 2, 16, device=DEVICE), torch.bfloat16)),
    }


# Each op's kernel launch on the op's arguments, as its CUDA branch makes it (the CPU runs it under the interpreter).
KERNELS = {
    "rotary_cache_write": rotary_cache_write,
    "silu_mul_quantize_fp8": lambda gate, up, group: silu_mul_quant.silu_mul_quantize_fp8_rows(gate, up, group or
                                                                                           gate.shape[-1]),
    "norm_quant_fp8": lambda x, w, b, eps, group, rms: norm_quant_fp8(x, w, b, eps, group, rms=rms)[:2],
    "add_norm_quant_fp8": lambda x, res, w, b, eps, group, rms: norm_quant_fp8(x, w, b, eps, group, rms=rms,
                                                                               residual=res)[:3],
    "decode_attention": attention_kernels.decode_attention,
    "decode_attention, q made [B, Hq, Q, D]": attention_kernels.decode_attention,
    "decode_attention_quantize_fp8": attention_kernels.decode_attention_quantized,
}


def assert_fake_layout(name, op, args, real):
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real, fake = (out if isinstance(out, tuple) else (out,) for out in (real, fake))
    assert len(real) == len(fake)
    for i, (r, f) in enumerate(zip(real, fake, strict=True)):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), (name, i)


@pytest.mark.parametrize("name", list(KERNELS))
def test_fake_outputs_have_the_kernels_layout(name):
    op, args = cases()[name]
    assert_fake_layout(name, op, args, KERNELS[name](*args))


@pytest.mark.parametrize("name", list(cases()))
def test_fake_outputs_have_the_real_outputs_layout(name):
    op, args = cases()[name]
    assert_fake_layout(name, op, args, op(*args))
