"""Every Triton kernel of fxquant.kernels compiles for sm_90 with the arguments its launcher gives it, on the CPU.

The kernel tests run under Triton's interpreter, which never compiles: a kernel the compiler refuses passed them and
failed only on the GPU (a gated-MLP quantizer cut across programs, a77da2b). Here each launcher runs once at a small
shape in each of its kernels' variants, its launches are recorded, and each is compiled as the GPU compiles it
(tests/sm90_compile.py). The inline-PTX kernels run under the interpreter only through the PTX emulator; bench.sass
compiles them (bench/tests/test_bench_sass.py). A kernel that neither reaches fails the coverage check below, so a
new kernel is compiled here from the day it is added."""

import importlib
import pkgutil

import pytest
import torch

import fxquant.kernels
from fxquant.kernels import splitk
from fxquant.kernels.decode_attention import decode_attention, decode_attention_quantized
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_grouped import (
    grouped_fp8_mm,
    grouped_int4_fp8_mm,
    grouped_int4_fp8_over_e4m3,
    grouped_weight_only_mm,
)
from fxquant.kernels.gemm_int4_fp8 import int4_as_e4m3, int4_fp8_mm
from fxquant.kernels.gemm_weight_only import weight_only_mm
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8
from fxquant.kernels.quant_fp8 import quantize_fp8_rows, quantize_fp8_static, quantize_fp8_tensor
from fxquant.kernels.quant_mx import mxfp8_values
from fxquant.kernels.rotary_cache import rotary_cache_write
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows
from fxquant.kernels.unowned_rows import zero_unowned_rows
from fxquant.numerics import reference as R
from tests.sm90_compile import compile_errors, recorded_launches

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="on a GPU the suite compiles each kernel it launches, for that GPU")

# Inline PTX that only the emulator runs under the interpreter: compiled by bench/tests/test_bench_sass.py.
COMPILED_BY_BENCH_SASS = {"_int4_mma_kernel", "_fp4_mma_kernel"}
BF16 = torch.bfloat16
WEIGHT_THROUGH_A_DESCRIPTOR = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4,
                                   programs=264, WEIGHT_TMA=True)


_GEN = torch.Generator().manual_seed(0)


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=_GEN).to(dtype)


def _gemms():
    """The fp8 GEMM at decode (split K, summed by the last slice and by the reduce kernel; the weight also through a
    tensor descriptor) and past 128 rows (the persistent TMA kernel), row and block scales; the W4A8 GEMM and its
    codes made e4m3; the weight-only GEMMs over every 4-bit and 8-bit format, and the dequantizer past 128 rows
    (W4A8's codes made e4m3 also shifted by their groups' powers of two)."""
    for activations, weights in (("token", "channel"), (("group", 128), ("block", 128, 128))):
        qa = R.quantize(_randn(2, 1024), "fp8_e4m3", activations)
        qw = R.quantize(_randn(256, 1024), "fp8_e4m3", weights)
        fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, _randn(256), BF16)
        fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, BF16, WEIGHT_THROUGH_A_DESCRIPTOR)
        with splitk.reduce_in_gemm(False):
            fp8_scaled_mm(qa.data, qa.scale, qw.data, qw.scale, None, torch.float32)
        qa = R.quantize(_randn(130, 256), "fp8_e4m3", activations)
        fp8_scaled_mm(qa.data, qa.scale, qw.data[:, :256], qw.scale[:, :2] if qw.scale.shape[1] > 1 else qw.scale,
                      None, BF16)
    qa = R.quantize(_randn(3, 256), "fp8_e4m3", "token")
    qw = R.quantize(_randn(64, 256), "int4", ("group", 128))
    int4_fp8_mm(qa.data, qa.scale, qw.data, qw.scale, qw.zero_point, None, BF16)
    int4_as_e4m3(qw.data, qw.zero_point)  # past 128 rows, the codes made e4m3 for cuBLAS
    rows = R.quantize(_randn(64, 256), "int4", ("group", 128), symmetric=True, scale_mode="row_powers_of_two")
    int4_as_e4m3(rows.data, None, rows.scale, rows.row_scale)  # and shifted for its rowwise GEMM
    for fmt, granularity, group in (("int4", ("group", 128), 128), ("mxfp4", None, 32), ("nvfp4", None, 16),
                                    ("int8", "channel", 0), ("mxfp8", None, 32)):
        q = R.quantize(_randn(64, 256), fmt, *([granularity] if granularity else []))
        for rows in (2, 130):
            weight_only_mm(_randn(rows, 256, dtype=BF16), q.data, q.scale, fmt, group, 64, zero_point=q.zero_point,
                           global_scale=q.global_scale)


def _experts():
    """The grouped GEMMs of mixture-of-experts layers: fp8 (also through tensor descriptors, at many rows' tiles, and
    the zeroing of the rows CUTLASS's route leaves unwritten), weight-only int4 and W4A8, the latter also with every
    expert's codes made e4m3 for the grouped fp8 kernel (its route from 128 rows an expert)."""
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)
    x = _randn(7, 256, dtype=BF16)
    qa = R.quantize(x, "fp8_e4m3", "token")
    q = R.quantize_experts(_randn(3, 64, 256), "fp8_e4m3", "channel")
    grouped_fp8_mm(qa.data, qa.scale, offs, q.data, q.scale, BF16)
    for tiles in ((128, 4), (256, 3)):  # the plan's tiles through tensor descriptors, from 128 and 512 rows an expert
        grouped_fp8_mm(qa.data, qa.scale, offs, q.data, q.scale, BF16,
                       config=dict(TMA=True, BLOCK_M=tiles[0], BLOCK_N=128, num_warps=8, num_stages=tiles[1]))
    zero_unowned_rows(torch.empty(7, 64, dtype=BF16), offs)
    q = R.quantize_experts(_randn(3, 64, 256), "int4", ("group", 128))
    grouped_weight_only_mm(x, offs, q.data, q.scale, "int4", 128, 64, zero_point=q.zero_point)
    grouped_int4_fp8_mm(qa.data, qa.scale, offs, q.data, q.scale, q.zero_point)
    grouped_int4_fp8_over_e4m3(torch.empty(7, 64, dtype=BF16), qa.data, qa.scale, offs, q.data, q.scale,
                               q.zero_point)


def _row_kernels():
    """The quantizers (per token, in groups, static, per tensor), the norm with its quantizer, the gated MLP's
    quantizer, and MXFP8's values."""
    x = _randn(3, 512, dtype=BF16)
    for row_len in (512, 128):
        quantize_fp8_rows(x, row_len)
    quantize_fp8_static(x, torch.tensor([0.01]))
    quantize_fp8_tensor(x)
    for group in (0, 128):
        norm_quant_fp8(x, _randn(512, dtype=BF16), group_size=group, residual=_randn(3, 512, dtype=BF16))
    gate, up = _randn(2, 4096, dtype=BF16), _randn(2, 4096, dtype=BF16)
    silu_mul_quantize_fp8_rows(gate, up, 4096)
    mxfp8_values(x)


def _attention():
    """Rotary embedding with the cache write, over a bf16 cache and into e4m3 codes; decode attention over both
    caches, merged by the last split and by the merge kernel, and quantizing its output per token and in groups."""
    B, HQ, HKV, D, S = 1, 4, 2, 64, 130
    qkv = _randn(B, 1, (HQ + 2 * HKV) * D, dtype=BF16)
    q, k, v = (t.view(B, 1, -1, D).transpose(1, 2) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    angles = _randn(1, 1, 1, D)
    cos, sin, positions = angles.cos().to(BF16), angles.sin().to(BF16), torch.tensor([5])
    k_cache, v_cache = _randn(B, HKV, S, D, dtype=BF16), _randn(B, HKV, S, D, dtype=BF16)
    q_rot = rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache)
    codes = [(torch.zeros(B, HKV, S, D, dtype=torch.float8_e4m3fn), torch.ones(B, HKV, S, 1)) for _ in range(2)]
    rotary_cache_write(q, k, v, cos, sin, positions, codes[0][0].view(torch.uint8), codes[1][0].view(torch.uint8),
                       codes=(positions, codes[0][1], codes[1][1]), append=True)
    plain = (q_rot, k_cache, v_cache, None, D**-0.5, 0.0, None, None, None, None)
    decode_attention(*plain)
    decode_attention(q_rot, codes[0][0], codes[1][0], None, D**-0.5, 0.0, None, codes[0][1][..., 0],
                     codes[1][1][..., 0], None)
    with splitk.reduce_in_gemm(False):
        decode_attention(*plain)
    for group in (0, 32):
        decode_attention_quantized(*plain, group)


def _kernels() -> set[str]:
    """Every Triton kernel defined in fxquant.kernels."""
    found = set()
    for module in pkgutil.iter_modules(fxquant.kernels.__path__):
        for name, value in vars(importlib.import_module(f"fxquant.kernels.{module.name}")).items():
            if name.endswith("_kernel") and getattr(value, "fn", None) is not None and value.fn.__name__ == name:
                found.add(name)
    return found


def test_every_kernel_compiles_for_sm90_as_its_launcher_calls_it():
    with recorded_launches() as launches:
        _gemms()
        _experts()
        _row_kernels()
        _attention()
    launched = {launch["kernel"].rsplit(".", 1)[1] for launch in launches}
    assert _kernels() - launched - COMPILED_BY_BENCH_SASS == set(), "kernels no launcher here reaches"
    assert compile_errors(launches) == {}
