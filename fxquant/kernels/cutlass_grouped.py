"""Row-scaled grouped fp8 GEMMs through torch's CUTLASS kernel (`torch._scaled_grouped_mm`) on sm_90, where it was
measured faster than the grouped Triton kernel: on Mixtral's experts (H100, `python -m bench.grouped_tiles` at
3293a8d) gate/up and down took 2074 and 1039 us at 4096 tokens against the TMA plan's 2287 and 1113, 749 and 362 at
1024 against 824 and 379, bit for bit the dense kernel's product (fp32 accumulation, row scales in the epilogue)
(docs/decisions/0039-moe-row-scaled-experts-on-cutlass.md).

Its output is allocated empty and rows past the last expert's end are never written; fxquant's grouped GEMMs make
them zero, so `unowned_rows.zero_unowned_rows` zeroes them on the device (no host sync: a CUDA graph replays it).
Only the layout measured is sent: e4m3 operands, rows and weights contiguous with K and N multiples of 16, scales per
token or tensor and per channel or tensor, bf16 out, past 128 rows an active expert.
"""

from __future__ import annotations

import torch

from fxquant.kernels.cast import capability
from fxquant.kernels.launch import cdiv
from fxquant.kernels.unowned_rows import zero_unowned_rows

CUTLASS_ABOVE_M = 128  # rows an active expert: what `bench.grouped_tiles` timed (256 and 1024)


def supports(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             out_dtype: torch.dtype) -> str | None:
    """Why `cutlass_grouped_fp8` does not take this product, or None where it does: a [M, K] and b [E, N, K] e4m3,
    contiguous and 16-byte aligned, K and N multiples of 16, scales per token (or tensor) and per channel (or
    tensor), bf16 out, on sm_90 with more than CUTLASS_ABOVE_M rows an expert."""
    if not (a.is_cuda and capability(a.device) == (9, 0) and hasattr(torch, "_scaled_grouped_mm")):
        return "torch's CUTLASS grouped fp8 GEMM runs on sm_90"
    return layout_refusal(a, a_scale, b, b_scale, out_dtype)


def layout_refusal(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype) -> str | None:
    """What in the operands alone keeps `cutlass_grouped_fp8` from the product (`supports` without the device)."""
    (M, K), (E, N) = a.shape, b.shape[:2]
    if cdiv(M, min(M, E)) <= CUTLASS_ABOVE_M:
        return f"{cdiv(M, min(M, E))} rows an expert: the Triton kernel serves up to {CUTLASS_ABOVE_M}"
    if out_dtype != torch.bfloat16 or not (a.dtype == b.dtype == torch.float8_e4m3fn):
        return f"{a.dtype} x {b.dtype} -> {out_dtype}: it takes e4m3 to bf16"
    if not (a.is_contiguous() and b.is_contiguous()) or not N or K % 16 or N % 16 or a.data_ptr() % 16 or \
            b.data_ptr() % 16:
        return f"K = {K}, N = {N}: it takes contiguous, 16-byte aligned rows, K and N multiples of 16"
    if a_scale.numel() not in (1, M) or b_scale.numel() not in (E, E * N):
        return f"scales {tuple(a_scale.shape)}, {tuple(b_scale.shape)}: not per token and channel (or tensor)"
    return None


def cutlass_grouped_fp8(a: torch.Tensor, a_scale: torch.Tensor, offs: torch.Tensor, b: torch.Tensor,
                        b_scale: torch.Tensor) -> torch.Tensor:
    """The row-scaled grouped product [M, N] in bf16 (`supports` first): each expert's rows of a times its b[e].T,
    fp32 accumulation promoted as cuBLAS's (no fast accumulation), the scales in the epilogue; unowned rows zero."""
    (M, _), (E, N) = a.shape, b.shape[:2]
    rows = a_scale.reshape(-1).float().expand(M).contiguous()  # per-tensor scales as every row's
    channels = b_scale.reshape(E, -1).float().expand(E, N).contiguous()
    out = torch._scaled_grouped_mm(a, b.transpose(1, 2), rows, channels, offs=offs, out_dtype=torch.bfloat16,
                                   use_fast_accum=False)
    return zero_unowned_rows(out, offs)
