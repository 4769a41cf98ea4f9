"""Large-M fp8 GEMMs through cuBLAS (`torch._scaled_mm`), where it was measured faster than the Triton kernel.

H200, torch 2.11: at M = 1024 and 4096 cuBLAS ran rowwise at 1097-1213 TF/s against fxquant's persistent TMA
kernel's 899-1042, and blockwise (1x128 activations, 128x128 weights) at 1033-1115 against 774-808
(docs/decisions/0003-persistent-tma-fp8-gemm.md); at M = 128 either was up to 25% faster depending on the shape, and at
decode the Triton kernel wins (cuBLAS blockwise refuses M = 1). End to end this took fp8_block prefill from 0.97x to
1.31x Inductor bf16 (docs/decisions/0007-cublas-fp8-past-m128.md). Only the three recipe layouts, with
the call shapes `bench/fp8_gemm.py` ran, are sent; anything else (a bias, an output other than bf16, unaligned N or
K, other scale blocks) stays on the Triton kernels, which also give the clear error for malformed scales.
"""

from __future__ import annotations

import torch

CUBLAS_ABOVE_M = 128
# Weights of more than 8192 rows (gate/up, 14336 and 28672 x 4096) go to cuBLAS from M = 128: 1.3-1.4x the Triton
# kernel there, 0.7-0.9x at M = 64 (docs/decisions/0007-cublas-fp8-past-m128.md).
WIDE_N, CUBLAS_WIDE_FROM_M = 8192, 128


def supports(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias,
             out_dtype: torch.dtype, block_scales: bool) -> str | None:
    """Why `cublas_scaled_mm` does not run this product (on a CUDA device), or None where it does: large M (see
    above), a [M, K] and w [N, K] contiguous e4m3, no bias, bf16 out, and scales per tensor, per token and channel, or
    1x128 and 128x128."""
    (M, K), N = a.shape, w.shape[0]
    align = 128 if block_scales else 16  # cuBLAS fp8: 16-byte rows; 128x128 weight blocks must tile N and K
    if block_scales:
        layout = a_scale.shape == (M, K // 128) and w_scale.shape == (N // 128, K // 128)
    else:
        layout = (a_scale.numel() == 1 and w_scale.numel() == 1) or (
            a_scale.shape == (M, 1) and w_scale.numel() == N)
    if not (M > CUBLAS_ABOVE_M or (N > WIDE_N and M >= CUBLAS_WIDE_FROM_M)):
        return f"M = {M}: the Triton kernel is faster up to {CUBLAS_ABOVE_M} ({CUBLAS_WIDE_FROM_M} past N = {WIDE_N})"
    if bias is not None or out_dtype != torch.bfloat16:
        return "a bias or an output other than bf16"
    if not (a.dtype == w.dtype == torch.float8_e4m3fn and a.is_contiguous() and w.is_contiguous()):
        return f"operands {a.dtype}, {w.dtype}: cuBLAS takes contiguous e4m3"
    if N % align or K % align:
        return f"N = {N}, K = {K}: cuBLAS takes multiples of {align}"
    if not layout:
        return f"scales {tuple(a_scale.shape)}, {tuple(w_scale.shape)}: not per tensor, token and channel, or blocks"
    return None


# Rows a block-scaled product hands cuBLAS come in multiples of this. W4A8 experts' uneven row counts failed in
# cuBLAS's 1x128 block-scaled GEMM on the H200 (CUBLAS_STATUS_NOT_SUPPORTED) where M = 200 and multiples of
# 16 ran; which counts it refuses is not established, so every count goes up to a multiple of 16.
BLOCK_SCALED_ROWS = 16


def block_scaled_rows(a: torch.Tensor, a_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, K] e4m3 and its 1x128 scales [M, K/128] as cuBLAS takes them: rows padded with zeros to a multiple of
    BLOCK_SCALED_ROWS (a copy of a, small against the product; none where M is a multiple), their scales 1, and the
    scale grid outer-dimension-major. The product's first M rows are a's."""
    M, K = a.shape
    rows = -(-M // BLOCK_SCALED_ROWS) * BLOCK_SCALED_ROWS
    if rows != M:
        padded = a.new_empty((rows, K))
        padded.view(torch.uint8)[:M].copy_(a.view(torch.uint8))
        padded.view(torch.uint8)[M:].zero_()
        a = padded
    grid = a_scale.new_ones((a_scale.shape[1], rows))
    grid[:, :M] = a_scale.t()
    return a, grid.t()


def cublas_scaled_mm(a, a_scale, w, w_scale, block_scales: bool) -> torch.Tensor:
    """(a * a_scale) @ (w * w_scale).T in bf16; scales per tensor, per token/channel, or 1x128 / 128x128."""
    M = a.shape[0]
    if block_scales:  # cuBLAS wants both scale grids outer-dimension-major
        (a, sa), sw = block_scaled_rows(a, a_scale), w_scale.t()
    elif a_scale.numel() == 1:
        sa, sw = a_scale.reshape(()), w_scale.reshape(())
    else:
        sa, sw = a_scale, w_scale.reshape(1, -1)
    return torch._scaled_mm(a, w.t(), sa, sw, out_dtype=torch.bfloat16)[:M]
