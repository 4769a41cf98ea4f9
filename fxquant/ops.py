"""Every op the passes insert, as a `torch.library` op `fxquant::...` with a fake impl.

Dynamo, Inductor and torch.export see through these ops. CPU tensors run the pure-torch reference;
CUDA tensors run the Triton kernels where one serves the case, else the same reference on the GPU.

The ops are defined with `torch.library.define` and `torch.library.impl` rather than the `custom_op` decorator,
whose Python autograd and checking wrappers cost 10-18 us of host time per call on the H200's host against 1-4 us
this way (docs/decisions/0001-library-ops-over-custom-op.md): without CUDA graphs a
decode step is host-bound. The ops are for inference and have no autograd formula. With grad mode on, the backend
refuses, with the fix, a graph whose inputs require grad; called directly, an op lets torch's fallback differentiate
through the reference, and torch warns.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode

from fxquant import reference as R
from fxquant import reference_attention as RA
from fxquant import reference_norm as RN
from fxquant.api import quantize
from fxquant.granularity import Granularity, activation_granularity
from fxquant.kernels.cast import capability
from fxquant.kernels.cublas_fp8 import cublas_scaled_mm, cublas_takes
from fxquant.kernels.decode_attention import decode_attention as decode_attention_kernel
from fxquant.kernels.decode_attention import decode_attention_refusal
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm, is_block_scaled
from fxquant.kernels.gemm_grouped import grouped_fp8_mm, grouped_weight_only_mm
from fxquant.kernels.gemm_int4_mma import int4_mma_fits, int4_mma_mm, lane_layout_shape
from fxquant.kernels.gemm_weight_only import weight_only_mm
from fxquant.kernels.launch import inlined
from fxquant.kernels.norm_quant_fp8 import norm_quant_fp8 as norm_quant_kernel
from fxquant.kernels.norm_quant_fp8 import serves as norm_quant_serves
from fxquant.kernels.quant_fp8 import MAX_ROW_LEN, quantize_fp8_rows
from fxquant.kernels.quant_mx import mxfp8_values
from fxquant.quantized import Quantized

E4M3 = torch.float8_e4m3fn
# Rows of x, and of a weight, taken to fp32 at a time by the reference GEMMs: temporaries stay bounded at any M
# and no fp32 copy of a whole weight is ever made. A multiple of every scale block (16, 32, 128).
CHUNK_ROWS = 2048


def _rows(q: Quantized, start: int, stop: int) -> Quantized:
    """Rows [start, stop) of a 2-D Quantized; start and stop are multiples of its block rows."""
    def cut(t):
        if t is None or t.numel() == 1:
            return t
        block_rows = q.granularity.sizes[0] if q.granularity.kind == "block" else 1
        return t[start // block_rows: -(-stop // block_rows)]

    shape = torch.Size((stop - start, *q.shape[1:]))
    return replace(q, data=q.data[start:stop], scale=cut(q.scale), zero_point=cut(q.zero_point), shape=shape)


def _chunked_linear(x: Quantized | Tensor, qw: Quantized, bias: Tensor | None, out_dtype: torch.dtype,
                    x_fp32=None) -> Tensor:
    """x [M, K] @ dequantize(qw).T + bias with fp32 operands and accumulation and one cast to out_dtype, in
    CHUNK_ROWS x CHUNK_ROWS output tiles. x is a Quantized (dequantized per tile) or a tensor, which x_fp32
    (rows -> fp32 rows) may requantize first."""
    m, n = x.shape[0], qw.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=qw.data.device)
    for n0 in range(0, n, CHUNK_ROWS):
        n1 = min(n, n0 + CHUNK_ROWS)
        w = R.dequantize(_rows(qw, n0, n1), torch.float32)  # [n1 - n0, K]
        for m0 in range(0, m, CHUNK_ROWS):
            m1 = min(m, m0 + CHUNK_ROWS)
            if isinstance(x, Quantized):
                rows = R.dequantize(_rows(x, m0, m1), torch.float32)
            else:
                rows = x_fp32(x[m0:m1]) if x_fp32 else x[m0:m1].float()
            # Row-major rows: the CPU BLAS sums in an order set by the operand's layout (a transposed input gave
            # other bits on the H200 host's 16 threads), and an input's strides must not change the result.
            acc = rows.contiguous() @ w.T
            if bias is not None:
                acc += bias[n0:n1].float()
            out[m0:m1, n0:n1] = acc  # the one narrowing cast
    return out


def _weight_granularity(w: Tensor, w_scale: Tensor) -> Granularity:
    if w_scale.numel() == 1:
        return Granularity("tensor")
    if w_scale.shape[0] == w.shape[0]:
        return Granularity("channel")
    return Granularity("block", (w.shape[0] // w_scale.shape[0], w.shape[1] // w_scale.shape[1]))


def _op(schema: str, kernel) -> torch._ops.OpOverloadPacket:
    """Define `fxquant::<schema>` with `kernel` as its implementation on every device; returns the op. While
    kernels are inlined (fxquant.export.package), functionalization traces into `kernel`, as into a
    torch.library.triton_op's: its torch ops and its Triton launches; otherwise the op stays whole."""
    name, signature = schema.split("(", 1)
    torch.library.define(f"fxquant::{name}", "(" + signature)
    torch.library.impl(f"fxquant::{name}", "default", kernel)

    def traced_into(mode, op, types, args, kwargs):
        if not inlined():
            return mode.__torch_dispatch__(op, types, args, kwargs)
        with mode:
            return kernel(*args, **kwargs)

    torch.library.register_torch_dispatch(f"fxquant::{name}", FunctionalTensorMode, traced_into)
    return getattr(torch.ops.fxquant, name)


def _fake(name: str):
    return torch.library.register_fake(f"fxquant::{name}")


def _quantize_fp8(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """Dynamic e4m3 codes and fp32 scales of x [..., K]: per token (group_size 0), per 1 x group_size, or
    per tensor (group_size -1, scale of shape [1])."""
    if group_size < 0:
        q = quantize(x, "fp8_e4m3", "tensor")  # on CUDA two kernels: amax partials, then scale and codes
        return q.data, q.scale.reshape(1)
    row_len = group_size or x.shape[-1]
    if x.is_cuda and row_len <= MAX_ROW_LEN:
        return quantize_fp8_rows(x, row_len, E4M3)
    q = R.quantize(x, "fp8_e4m3", activation_granularity(group_size))
    return q.data, q.scale


quantize_fp8 = _op("quantize_fp8(Tensor x, int group_size) -> (Tensor, Tensor)", _quantize_fp8)


@_fake("quantize_fp8")
def _(x, group_size):
    if group_size < 0:
        return torch.empty_like(x, dtype=E4M3), x.new_empty((1,), dtype=torch.float32)
    groups = x.shape[-1] // group_size if group_size else 1
    return torch.empty_like(x, dtype=E4M3), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def _scaled_mm_fp8(a: Tensor, a_scale: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None,
                   out_dtype: torch.dtype) -> Tensor:
    """(a [..., K] * a_scale) @ (w [N, K] * w_scale).T + bias, fp32 accumulation, one cast to out_dtype.

    a_scale: [..., 1] per token or [..., K/g] per 1 x g group; w_scale: one element, [N, 1] or [N/128, K/128].
    """
    lead, K = a.shape[:-1], a.shape[-1]
    a2 = a.reshape(-1, K)
    s2 = a_scale.reshape(1) if a_scale.numel() == 1 else a_scale.reshape(-1, a_scale.shape[-1])
    if a.is_cuda:
        block = is_block_scaled(s2, w_scale, w.shape[0])
        if cublas_takes(a2, s2, w, w_scale, bias, out_dtype, block):
            out = cublas_scaled_mm(a2, s2, w, w_scale, block)
        else:
            out = fp8_scaled_mm(a2, s2, w, w_scale, bias, out_dtype)
    else:
        group = -1 if s2.dim() == 1 else 0 if s2.shape[1] == 1 else K // s2.shape[1]
        qa = Quantized(a2, s2.reshape(()) if group < 0 else s2, "fp8_e4m3", activation_granularity(group), a2.shape,
                       out_dtype)
        qw = Quantized(w, w_scale, "fp8_e4m3", _weight_granularity(w, w_scale), w.shape, out_dtype)
        out = _chunked_linear(qa, qw, bias, out_dtype)
    return out.reshape(*lead, w.shape[0])


scaled_mm_fp8 = _op("scaled_mm_fp8(Tensor a, Tensor a_scale, Tensor w, Tensor w_scale, Tensor? bias, "
                    "ScalarType out_dtype) -> Tensor", _scaled_mm_fp8)


@_fake("scaled_mm_fp8")
def _(a, a_scale, w, w_scale, bias, out_dtype):
    return a.new_empty((*a.shape[:-1], w.shape[0]), dtype=out_dtype)


def _linear_fp8(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None, group_size: int) -> Tensor:
    """F.linear with dynamic e4m3 activations (per token, or 1 x group_size) and a pre-quantized e4m3 weight."""
    # The implementations, not the ops: one dispatch per call instead of three (each 1-4 us of host time).
    a, a_scale = _quantize_fp8(x, group_size)
    return _scaled_mm_fp8(a, a_scale, w, w_scale, bias, x.dtype)


linear_fp8 = _op("linear_fp8(Tensor x, Tensor w, Tensor w_scale, Tensor? bias, int group_size) -> Tensor",
                 _linear_fp8)


@_fake("linear_fp8")
def _(x, w, w_scale, bias, group_size):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _linear_weight_only(x: Tensor, w: Tensor, w_scale: Tensor, w_global_scale: Tensor | None,
                        w_zero_point: Tensor | None, bias: Tensor | None, fmt: str, group_size: int,
                        out_features: int) -> Tensor:
    """F.linear with a weight-only quantized weight (int8, int4, mxfp4, nvfp4), activations untouched."""
    in_features = x.shape[-1]
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        out = weight_only_mm(x.reshape(-1, in_features), w, w_scale, fmt, group_size, out_features,
                             zero_point=w_zero_point, global_scale=w_global_scale, bias=bias)
        return out.reshape(*x.shape[:-1], out_features)
    gran = Granularity("channel") if group_size == 0 else Granularity("group", (group_size,))
    qw = Quantized(w, w_scale, fmt, gran, torch.Size((out_features, in_features)), x.dtype,
                   global_scale=w_global_scale, zero_point=w_zero_point)
    out = _chunked_linear(x.reshape(-1, in_features), qw, bias, x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


linear_weight_only = _op("linear_weight_only(Tensor x, Tensor w, Tensor w_scale, Tensor? w_global_scale, "
                         "Tensor? w_zero_point, Tensor? bias, str fmt, int group_size, int out_features) -> Tensor",
                         _linear_weight_only)


@_fake("linear_weight_only")
def _(x, w, w_scale, w_global_scale, w_zero_point, bias, fmt, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_int4_lanes(x: Tensor, w: Tensor, w_scale: Tensor, w_zero_point: Tensor | None, lane_scale: Tensor,
                       lane_zero: Tensor | None, bias: Tensor | None, group_size: int, out_features: int) -> Tensor:
    """linear_weight_only for an int4 weight whose scales and zero points are also held in the mma.sync decode
    kernel's per-lane layout (`gemm_int4_mma.pack_lanes`). One activation row on the GPU takes that kernel;
    every other case takes linear_weight_only on the row-major scales. At M = 8 the kernel ran 13-34% slower than
    the in-register one on four of five Llama shapes (docs/decisions/0008-int4-mma-lane-packed-scales-at-m1.md),
    so it serves M = 1."""
    rows = x.reshape(-1, x.shape[-1])
    K = rows.shape[1]
    if (rows.shape[0] == 1 and w.shape == (out_features, K // 2) and w.is_contiguous()
            and lane_scale.shape == lane_layout_shape(out_features, K, group_size) and int4_mma_fits(rows, group_size)):
        out = int4_mma_mm(rows, w.view(torch.int32), lane_scale, lane_zero, group_size, bias)
        return out.reshape(*x.shape[:-1], out_features)
    return _linear_weight_only(x, w, w_scale, None, w_zero_point, bias, "int4", group_size, out_features)


linear_int4_lanes = _op("linear_int4_lanes(Tensor x, Tensor w, Tensor w_scale, Tensor? w_zero_point, "
                        "Tensor lane_scale, Tensor? lane_zero, Tensor? bias, int group_size, int out_features) "
                        "-> Tensor", _linear_int4_lanes)


@_fake("linear_int4_lanes")
def _(x, w, w_scale, w_zero_point, lane_scale, lane_zero, bias, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _linear_mxfp8(x: Tensor, w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """MXFP8 activations (dynamic, blocks of 32) and weight. Hopper has no MX tensor cores, but bf16 holds MXFP8
    values exactly (down to 2^-133, below a block scale of 2^-124), so on CUDA bf16 activations are quantized and
    dequantized in one kernel and multiply the weight through the weight-only GEMM, which decodes its codes to bf16:
    the products of the MX operands, accumulated in fp32. Elsewhere (the CPU, fp16 activations, GPUs without fp8
    casts) the reference GEMM runs in fp32."""
    if x.is_cuda and x.dtype == torch.bfloat16 and capability(x.device) >= (8, 9):
        out = weight_only_mm(mxfp8_values(x.reshape(-1, x.shape[-1])), w, w_scale, "mxfp8", R.MX_BLOCK,
                             w.shape[0], bias=bias)
        return out.reshape(*x.shape[:-1], w.shape[0])
    qw = Quantized(w, w_scale, "mxfp8", Granularity("group", (R.MX_BLOCK,)), w.shape, x.dtype)
    out = _chunked_linear(x.reshape(-1, x.shape[-1]), qw, bias, x.dtype,
                          lambda rows: R.dequantize(R.quantize(rows, "mxfp8"), torch.float32))
    return out.reshape(*x.shape[:-1], w.shape[0])


linear_mxfp8 = _op("linear_mxfp8(Tensor x, Tensor w, Tensor w_scale, Tensor? bias) -> Tensor", _linear_mxfp8)


@_fake("linear_mxfp8")
def _(x, w, w_scale, bias):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _per_expert(x: Tensor, offs: Tensor, out_features: int, out_dtype: torch.dtype, expert_linear) -> Tensor:
    """The grouped GEMM by its definition, for devices and dtypes no kernel serves: expert_linear(e, rows), a slice
    of x's rows, on each expert's rows; the rows past offs[-1] belong to no expert and are zero."""
    out = x.new_zeros((x.shape[0], out_features), dtype=out_dtype)
    for e, rows in R.expert_rows(offs):  # one host sync: fine where no kernel runs
        out[rows] = expert_linear(e, rows)
    return out


def _check_grouped(x: Tensor, offs: Tensor, w: Tensor):
    if x.dim() != 2 or w.dim() != 3 or offs.shape != (w.shape[0],):
        raise ValueError(f"fxquant: a grouped linear takes x [M, K] sorted by expert, offs [E] and expert weights "
                         f"[E, N, K]; got x {tuple(x.shape)}, offs {tuple(offs.shape)}, w {tuple(w.shape)}")


def _grouped_scaled_mm_fp8(a: Tensor, a_scale: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor,
                           out_dtype: torch.dtype) -> Tensor:
    """The experts' fp8 products over rows sorted by expert (offs: int32 cumulative ends, as grouped_mm takes them):
    e4m3 activations a [M, K] with scales [M, 1], [M, K/128] or one element, and e4m3 experts w [E, N, K] with
    scales [E] (per tensor), [E, N, 1] (per channel) or [E, N/128, K/128] (blocks); fp32 accumulation, one cast."""
    _check_grouped(a, offs, w)
    if a.is_cuda and capability(a.device) >= (8, 9):
        return grouped_fp8_mm(a, a_scale, offs.int(), w, w_scale, out_dtype)
    per_tensor = a_scale.numel() == 1
    return _per_expert(a, offs, w.shape[1], out_dtype, lambda e, rows: _scaled_mm_fp8(
        a[rows], a_scale if per_tensor else a_scale[rows], w[e], w_scale[e], None, out_dtype))


grouped_scaled_mm_fp8 = _op("grouped_scaled_mm_fp8(Tensor a, Tensor a_scale, Tensor offs, Tensor w, Tensor w_scale, "
                            "ScalarType out_dtype) -> Tensor", _grouped_scaled_mm_fp8)


@_fake("grouped_scaled_mm_fp8")
def _(a, a_scale, offs, w, w_scale, out_dtype):
    return a.new_empty((a.shape[0], w.shape[1]), dtype=out_dtype)


def _grouped_linear_weight_only(x: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor, w_global_scale: Tensor | None,
                                w_zero_point: Tensor | None, fmt: str, group_size: int, out_features: int) -> Tensor:
    """The experts' linears over rows sorted by expert, with weight-only quantized experts (int8, int4, mxfp4,
    nvfp4, mxfp8 codes [E, N, ...]; NVFP4's global scale [E]), activations untouched."""
    _check_grouped(x, offs, w)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and (fmt != "mxfp8" or x.dtype == torch.bfloat16):
        return grouped_weight_only_mm(x, offs.int(), w, w_scale, fmt, group_size, out_features,
                                      zero_point=w_zero_point, global_scale=w_global_scale)
    pick = lambda t, e: None if t is None else t[e]
    return _per_expert(x, offs, out_features, x.dtype, lambda e, rows: _linear_weight_only(
        x[rows], w[e], w_scale[e], pick(w_global_scale, e), pick(w_zero_point, e), None, fmt, group_size, out_features))


grouped_linear_weight_only = _op(
    "grouped_linear_weight_only(Tensor x, Tensor offs, Tensor w, Tensor w_scale, Tensor? w_global_scale, "
    "Tensor? w_zero_point, str fmt, int group_size, int out_features) -> Tensor", _grouped_linear_weight_only)


@_fake("grouped_linear_weight_only")
def _(x, offs, w, w_scale, w_global_scale, w_zero_point, fmt, group_size, out_features):
    return x.new_empty((x.shape[0], out_features))


def _grouped_linear_mxfp8(x: Tensor, offs: Tensor, w: Tensor, w_scale: Tensor) -> Tensor:
    """The experts' linears over rows sorted by expert, MXFP8 activations and experts, as `linear_mxfp8` computes
    each: on CUDA, bf16 activations rounded to their MXFP8 values multiply the decoded codes."""
    _check_grouped(x, offs, w)
    if x.is_cuda and x.dtype == torch.bfloat16 and capability(x.device) >= (8, 9):
        return grouped_weight_only_mm(mxfp8_values(x), offs.int(), w, w_scale, "mxfp8", R.MX_BLOCK, w.shape[1])
    return _per_expert(x, offs, w.shape[1], x.dtype, lambda e, rows: _linear_mxfp8(x[rows], w[e], w_scale[e], None))


grouped_linear_mxfp8 = _op("grouped_linear_mxfp8(Tensor x, Tensor offs, Tensor w, Tensor w_scale) -> Tensor",
                           _grouped_linear_mxfp8)


@_fake("grouped_linear_mxfp8")
def _(x, offs, w, w_scale):
    return x.new_empty((x.shape[0], w.shape[1]))


def _sort_by_expert(ids: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rows grouped by expert for the grouped GEMMs: (order, inverse, offs) such that rows[order] are sorted by
    expert id, sorted[inverse] restores the row order, and offs (int32 [num_experts]) holds each expert's cumulative
    end. Ids past the last expert sort last and belong to none. No host sync: a CUDA graph replays it."""
    ids = ids.reshape(-1)
    sorted_ids, order = torch.sort(ids, stable=True)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=ids.device)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    return order, inverse, torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)


sort_by_expert = _op("sort_by_expert(Tensor ids, int num_experts) -> (Tensor, Tensor, Tensor)", _sort_by_expert)


@_fake("sort_by_expert")
def _(ids, num_experts):
    n = ids.numel()
    long = dict(dtype=torch.int64, device=ids.device)
    return ids.new_empty((n,), **long), ids.new_empty((n,), **long), ids.new_empty((num_experts,), dtype=torch.int32)


def _decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float,
                      sinks: Tensor | None, k_scale: Tensor | None, v_scale: Tensor | None,
                      kv_lens: Tensor | None) -> Tensor:
    """Attention of q [B, Hq, Q, D] over a KV cache k, v [B, Hkv, S, D] read as stored (high precision, or e4m3
    codes with fp32 k_scale / v_scale per (batch, KV head, token) or per tensor): reference_attention's numerics.
    CUDA: the split-KV kernel where it serves the operands; else the reference."""
    if q.is_cuda and decode_attention_refusal(q, k, v, mask) is None:
        return decode_attention_kernel(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens)
    return RA.decode_attention(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens)


decode_attention = _op("decode_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, float softcap, "
                       "Tensor? sinks, Tensor? k_scale, Tensor? v_scale, Tensor? kv_lens) -> Tensor",
                       _decode_attention)


@_fake("decode_attention")
def _(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens):
    return torch.empty_like(q)


def _dequantize_kv(codes: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """An e4m3 KV cache [B, Hkv, S, D] in `dtype`: codes * scale, per (batch, KV head, token) (scale [B, Hkv, S])
    or per tensor ([1]), in fp32, then one rounding to dtype."""
    return RA.dequantized_cache(codes, scale).to(dtype)


dequantize_kv = _op("dequantize_kv(Tensor codes, Tensor scale, ScalarType dtype) -> Tensor", _dequantize_kv)


@_fake("dequantize_kv")
def _(codes, scale, dtype):
    return torch.empty_like(codes, dtype=dtype)


def _uniform_offsets(x: Tensor, num_experts: int) -> Tensor:
    """offs (int32 [num_experts]) for rows x [num_experts * T, ...] in equal blocks, one per expert: experts run
    densely over every token (Llama4's), so the grouped GEMMs serve them with no sort."""
    per_expert = x.shape[0] // num_experts
    return torch.arange(1, num_experts + 1, device=x.device, dtype=torch.int32) * per_expert


uniform_offsets = _op("uniform_offsets(Tensor x, int num_experts) -> Tensor", _uniform_offsets)


@_fake("uniform_offsets")
def _(x, num_experts):
    return x.new_empty((num_experts,), dtype=torch.int32)


def _norm_quant(x, residual, weight, bias, eps, group_size, rms):
    if x.is_cuda and norm_quant_serves(x.shape[-1], group_size):
        codes, scales, h, _ = norm_quant_kernel(x, weight, bias, eps, group_size, rms=rms, residual=residual)
        return codes, scales, h
    codes, scales, h, _ = RN.norm_quant_fp8(x, weight, bias, eps, group_size, rms=rms, residual=residual)
    return codes, scales, h


def _norm_quant_fp8(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, group_size: int,
                    rms: bool) -> tuple[Tensor, Tensor]:
    """RMSNorm (rms) or LayerNorm of x [..., D], rounded to x's dtype, then dynamic e4m3 per token
    (group_size 0) or 1 x group_size: (codes, fp32 scales), as quantize_fp8(norm(x)) gives them."""
    codes, scales, _ = _norm_quant(x, None, weight, bias, eps, group_size, rms)
    return codes, scales


norm_quant_fp8 = _op("norm_quant_fp8(Tensor x, Tensor? weight, Tensor? bias, float eps, int group_size, bool rms) "
                     "-> (Tensor, Tensor)", _norm_quant_fp8)


@_fake("norm_quant_fp8")
def _(x, weight, bias, eps, group_size, rms):
    groups = x.shape[-1] // group_size if group_size else 1
    return torch.empty_like(x, dtype=E4M3), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def _add_norm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                        group_size: int, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    """h = x + residual (in x's dtype), then norm_quant_fp8(h): (codes, scales, h)."""
    return _norm_quant(x, residual, weight, bias, eps, group_size, rms)


add_norm_quant_fp8 = _op("add_norm_quant_fp8(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
                         "int group_size, bool rms) -> (Tensor, Tensor, Tensor)", _add_norm_quant_fp8)


@_fake("add_norm_quant_fp8")
def _(x, residual, weight, bias, eps, group_size, rms):
    groups = x.shape[-1] // group_size if group_size else 1
    return (torch.empty_like(x, dtype=E4M3), x.new_empty((*x.shape[:-1], groups), dtype=torch.float32),
            torch.empty_like(x))
