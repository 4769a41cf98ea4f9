"""The custom ops: opcheck (schema, fake impl, autograd registration) and their numbers."""

import pytest
import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8_LIKE = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def opcheck(op, args):
    """torch.library.opcheck; torch's schema check compares inputs with allclose, which fp8 dtypes lack,
    so for fp8 inputs that one check is replaced by a bitwise no-mutation check."""
    fp8_args = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in FP8_LIKE]
    if not fp8_args:
        torch.library.opcheck(op, args)
        return
    before = [a.view(torch.uint8).clone() for a in fp8_args]
    torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_autograd_registration",
                                                "test_aot_dispatch_dynamic"))
    op(*args)
    assert all(torch.equal(a.view(torch.uint8), b) for a, b in zip(fp8_args, before, strict=True))


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("group", [0, 128])
def test_quantize_fp8_op(group):
    x = randn(3, 5, 256, dtype=torch.bfloat16)
    opcheck(torch.ops.fxquant.quantize_fp8, (x, group))
    data, scale = torch.ops.fxquant.quantize_fp8(x, group)
    ref = R.quantize(x, "fp8_e4m3", ("group", group) if group else "token")
    assert torch.equal(data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(scale, ref.scale)


@pytest.mark.parametrize("wgran, group", [("channel", 0), (("block", 128, 128), 128), ("tensor", 0)])
def test_linear_fp8_op(wgran, group):
    x, w, bias = randn(2, 3, 256, dtype=torch.bfloat16), randn(384, 256) * 0.05, randn(384)
    qw = R.quantize(w, "fp8_e4m3", wgran)
    args = (x, qw.data, qw.scale, bias, group)
    opcheck(torch.ops.fxquant.linear_fp8, args)
    out = torch.ops.fxquant.linear_fp8(*args)
    assert out.shape == (2, 3, 384) and out.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + bias.double()
    assert float((out.double() - exact).norm() / exact.norm()) < 0.06  # e4m3 on both operands


@pytest.mark.parametrize("agran, wgran", [("token", "channel"), (("group", 128), ("block", 128, 128)),
                                          ("tensor", "tensor")], ids=str)
def test_scaled_mm_fp8_op(agran, wgran):
    a, w, bias = randn(2, 3, 256, dtype=torch.bfloat16), randn(384, 256) * 0.05, randn(384)
    qa, qw = R.quantize(a, "fp8_e4m3", agran), R.quantize(w, "fp8_e4m3", wgran)
    a_scale = qa.scale.reshape(1) if agran == "tensor" else qa.scale
    args = (qa.data, a_scale, qw.data, qw.scale, bias, torch.float32)
    opcheck(torch.ops.fxquant.scaled_mm_fp8, args)
    out = torch.ops.fxquant.scaled_mm_fp8(*args)
    assert out.shape == (2, 3, 384) and out.dtype == torch.float32
    exact = R.dequantize(qa, torch.float64) @ R.dequantize(qw, torch.float64).T + bias.double()
    # Exact fp8 operands, fp32 accumulation and output: off by the accumulation's rounding only.
    assert float((out.double() - exact).norm() / exact.norm()) < 1e-5


@pytest.mark.parametrize("fmt, group", [("int8", 0), ("int4", 128), ("mxfp4", 32), ("nvfp4", 16)])
def test_linear_weight_only_op(fmt, group):
    x, w = randn(4, 256, dtype=torch.bfloat16), randn(128, 256) * 0.05
    q = R.quantize(w, fmt, "channel" if fmt == "int8" else None)
    args = (x, q.data, q.scale, q.global_scale, q.zero_point, None, fmt, group, 128)
    opcheck(torch.ops.fxquant.linear_weight_only, args)
    out = torch.ops.fxquant.linear_weight_only(*args)
    exact = x.double() @ R.dequantize(q, torch.float64).T
    # Exact operands, fp32 accumulation, one bf16 rounding (the CUDA kernel's bound is in test_gemm_weight_only).
    assert out.dtype == torch.bfloat16 and float((out.double() - exact).norm() / exact.norm()) < 2**-8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("M", [1, 16, 200])
def test_linear_mxfp8_op(M, dtype):
    """On CUDA, bf16 takes the bf16-values path (its bound: tests/kernels/test_quant_mx.py) and fp16 the fp32
    reference; one NaN activation poisons its own row only."""
    x, w, bias = randn(M, 256, dtype=dtype), randn(128, 256) * 0.05, randn(128, dtype=dtype)
    qw = R.quantize(w, "mxfp8")
    opcheck(torch.ops.fxquant.linear_mxfp8, (x, qw.data, qw.scale, bias))  # its output comparison fails on NaN
    x[0, 5] = float("nan")
    out = torch.ops.fxquant.linear_mxfp8(x, qw.data, qw.scale, bias)
    assert out.shape == (M, 128) and out.dtype == dtype
    assert out[0].isnan().all() and not out[1:].isnan().any()
    exact = R.dequantize(R.quantize(x[1:], "mxfp8"), torch.float64) @ R.dequantize(qw, torch.float64).T
    exact = exact + bias.double()
    assert M == 1 or float((out[1:].double() - exact).norm() / exact.norm()) < 2**-8  # one 16-bit rounding


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("group", [0, 128])
def test_norm_quant_fp8_ops(rms, group):
    torch.manual_seed(0)
    x, r, w = randn(2, 3, 256, dtype=torch.bfloat16), randn(2, 3, 256, dtype=torch.bfloat16), randn(256)
    b = None if rms else randn(256)
    opcheck(torch.ops.fxquant.norm_quant_fp8, (x, w, b, 1e-6, group, rms))
    opcheck(torch.ops.fxquant.add_norm_quant_fp8, (x, r, w, b, 1e-6, group, rms))
    codes, scales, h = torch.ops.fxquant.add_norm_quant_fp8(x, r, w, b, 1e-6, group, rms)
    assert torch.equal(h, x + r)  # a bf16 add, rounded once
    # The op's numbers against quantize_fp8 of the library norm: statistics may differ by an ulp.
    ref_norm = (torch.nn.functional.rms_norm(h.float(), (256,), w, 1e-6) if rms else
                torch.nn.functional.layer_norm(h.float(), (256,), w, b, 1e-6)).to(torch.bfloat16)
    ref_codes, ref_scales = torch.ops.fxquant.quantize_fp8(ref_norm, group)
    assert float((scales / ref_scales - 1).abs().max()) <= 2**-8  # at most one bf16 ulp of a group's amax
    assert (codes.float() != ref_codes.float()).float().mean() < 0.01



def expert_routing(m=9, experts=3):
    """Rows sorted by expert (one expert empty) and the grouped_mm offsets, plus rows no expert owns."""
    offs = torch.tensor([4, 4, m - 2], device=DEVICE, dtype=torch.int32)
    return offs, experts


@pytest.mark.parametrize("wgran, group", [("channel", 0), (("block", 128, 128), 128), ("tensor", -1)])
def test_grouped_scaled_mm_fp8_op(wgran, group):
    offs, experts = expert_routing()
    x = randn(9, 256, dtype=torch.bfloat16)
    a, a_scale = torch.ops.fxquant.quantize_fp8(x, group)
    qw = R.quantize_experts(randn(experts, 128, 256) * 0.05, "fp8_e4m3", wgran)
    args = (a, a_scale, offs, qw.data, qw.scale, torch.bfloat16)
    opcheck(torch.ops.fxquant.grouped_scaled_mm_fp8, args)
    out = torch.ops.fxquant.grouped_scaled_mm_fp8(*args)
    ref = R.grouped_linear(R.dequantize(R.quantize(x, "fp8_e4m3", {0: "token", -1: "tensor"}.get(
        group, ("group", group))), torch.float32), offs, qw, torch.bfloat16)
    assert torch.equal(out[7:], torch.zeros_like(out[7:]))  # rows past offs[-1]
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-3


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
def test_grouped_scaled_mm_int4_fp8_op(symmetric):
    """The experts' W4A8 op: each expert's rows through the dense op (the reference on the CPU, the kernels on a
    GPU), within bf16's rounding of the product."""
    offs, experts = expert_routing()
    x = randn(9, 256, dtype=torch.bfloat16)
    a, a_scale = torch.ops.fxquant.quantize_fp8(x, 0)
    qw = R.quantize_experts(randn(experts, 128, 256) * 0.05, "int4", ("group", 128), symmetric=symmetric)
    args = (a, a_scale, offs, qw.data, qw.scale, qw.zero_point, 128, 128, torch.bfloat16)
    opcheck(torch.ops.fxquant.grouped_scaled_mm_int4_fp8, args)
    out = torch.ops.fxquant.grouped_scaled_mm_int4_fp8(*args)
    ref = R.grouped_linear(R.dequantize(R.quantize(x, "fp8_e4m3", "token"), torch.float32), offs, qw, torch.bfloat16)
    assert torch.equal(out[7:], torch.zeros_like(out[7:]))  # rows past offs[-1]
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-3


@pytest.mark.parametrize("fmt", ["int8", "int4", "mxfp4", "nvfp4"])
def test_grouped_linear_weight_only_op(fmt):
    offs, experts = expert_routing()
    x = randn(9, 256, dtype=torch.bfloat16)
    qw = R.quantize_experts(randn(experts, 128, 256) * 0.05, fmt, "channel" if fmt == "int8" else None)
    group = {"int8": 0, "int4": 128, "mxfp4": 32, "nvfp4": 16}[fmt]
    args = (x, offs, qw.data, qw.scale, qw.global_scale, qw.zero_point, fmt, group, 128)
    opcheck(torch.ops.fxquant.grouped_linear_weight_only, args)
    out = torch.ops.fxquant.grouped_linear_weight_only(*args)
    ref = R.grouped_linear(x, offs, qw)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-3


def test_grouped_linear_mxfp8_op():
    offs, experts = expert_routing()
    x = randn(9, 256, dtype=torch.bfloat16)
    qw = R.quantize_experts(randn(experts, 128, 256) * 0.05, "mxfp8")
    opcheck(torch.ops.fxquant.grouped_linear_mxfp8, (x, offs, qw.data, qw.scale))
    out = torch.ops.fxquant.grouped_linear_mxfp8(x, offs, qw.data, qw.scale)
    ref = R.grouped_linear(R.dequantize(R.quantize(x, "mxfp8"), torch.float32), offs, qw, torch.bfloat16)
    assert float((out.float() - ref.float()).norm() / ref.float().norm()) < 2e-3


def test_sort_by_expert_op():
    ids = torch.tensor([[2, 0], [0, 3], [2, 2], [5, 0]], device=DEVICE)  # 5: past the last of 4 experts
    opcheck(torch.ops.fxquant.sort_by_expert, (ids, 4))
    order, inverse, offs = torch.ops.fxquant.sort_by_expert(ids, 4)
    flat = ids.reshape(-1)
    assert offs.dtype == torch.int32 and offs.tolist() == [3, 3, 6, 7]
    assert flat[order].tolist() == [0, 0, 0, 2, 2, 2, 3, 5]
    assert torch.equal(flat[order][inverse], flat)


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_tensor"])
def test_dequantize_kv_op(per_token):
    """codes * scale in fp32, one rounding to the dtype: the values a bf16 cache of the fake-quantized K would hold."""
    k = randn(2, 3, 17, 64, dtype=torch.bfloat16)
    q = R.quantize(k, "fp8_e4m3", "token" if per_token else "tensor")
    scale = q.scale.reshape(2, 3, 17) if per_token else q.scale.reshape(1)
    opcheck(torch.ops.fxquant.dequantize_kv, (q.data, scale, torch.bfloat16))
    got = torch.ops.fxquant.dequantize_kv(q.data, scale, torch.bfloat16)
    assert torch.equal(got, R.dequantize(q, torch.bfloat16))


def _call_arguments(line: str) -> list[str]:
    """The top-level arguments of the call that opens on `line` of Inductor's output code."""
    inside = line[line.index("(") + 1:]
    args, depth, start = [], 0, 0
    for i, ch in enumerate(inside):
        if ch in "([":
            depth += 1
        elif ch in ")]" and depth:
            depth -= 1
        elif ch == ")" or (ch == "," and depth == 0):
            args.append(inside[start:i].strip())
            start = i + 1
            if ch == ")":
                break
    return args


def test_inductor_computes_a_mask_every_layer_reads_once():
    """Two layers' fxquant::decode_attention read the step's one mask: Inductor computes it once and hands both calls
    the same buffer (the decode ops take their inputs' layouts as they are). Under exact strides it copied the mask
    for each call, recomputing it there: on the GPU one kernel a layer."""
    from torch._inductor.utils import run_and_get_code

    keys, dim = 64, 64
    q = randn(2, 1, 4, 1, dim, dtype=torch.bfloat16)  # two layers' queries
    k, v = randn(1, 2, keys, dim, dtype=torch.bfloat16), randn(1, 2, keys, dim, dtype=torch.bfloat16)
    position = torch.tensor(9, device=DEVICE)

    def step(q, k, v, position):
        mask = (torch.arange(keys, device=q.device) <= position)[None, None, None, :].expand(1, 1, 1, keys)
        return torch.stack([torch.ops.fxquant.decode_attention(q[i], k, v, mask, dim**-0.5, 0.0, None, None, None,
                                                               None) for i in range(2)])

    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(torch.compile(step), q, k, v, position)
    torch._dynamo.reset()
    calls = [line for code in codes for line in code.splitlines() if "fxquant.decode_attention.default(" in line]
    masks = {_call_arguments(line)[3] for line in calls}
    assert len(calls) == 2 and len(masks) == 1, calls
    assert torch.equal(got, step(q, k, v, position))


def test_inductor_computes_cos_and_sin_every_layer_reads_once():
    """The same for fxquant::rotary_cache_write: two layers' calls read one cos and one sin, computed once."""
    from torch._inductor.utils import run_and_get_code

    keys, dim = 16, 64
    q, k, v = (randn(2, 1, h, 1, dim, dtype=torch.bfloat16) for h in (4, 2, 2))  # two layers' q, k, v
    caches = [randn(1, 2, keys, dim, dtype=torch.bfloat16) for _ in range(4)]
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=DEVICE, dtype=torch.float32) / dim)
    position = torch.tensor([5], device=DEVICE)

    def step(q, k, v, position, caches):
        angles = torch.cat([position[:, None] * inv_freq] * 2, dim=-1)[None]  # [1, 1, dim]
        cos, sin = angles.cos(), angles.sin()
        return torch.stack([torch.ops.fxquant.rotary_cache_write(q[i], k[i], v[i], cos, sin, position,
                                                                 caches[2 * i], caches[2 * i + 1]) for i in range(2)])

    eager_caches = [c.clone() for c in caches]
    want = step(q, k, v, position, eager_caches)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(torch.compile(step), q, k, v, position, caches)
    torch._dynamo.reset()
    calls = [line for code in codes for line in code.splitlines() if "fxquant.rotary_cache_write.default(" in line]
    assert len(calls) == 2 and len({tuple(_call_arguments(line)[3:5]) for line in calls}) == 1, calls
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(caches, eager_caches, strict=True))
