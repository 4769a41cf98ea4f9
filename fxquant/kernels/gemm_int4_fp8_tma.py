"""W4A8 past 128 rows an expert with the int4 codes decoded in the K loop: no e4m3 copy of the weight.

The copy engine moves each tile's e4m3 activations and its packed codes (half the bytes of e4m3 codes) into shared
memory; the warps turn each byte of two codes into two e4m3 bytes in three integer instructions per eight codes and
multiply them on the fp8 tensor cores. The trick that makes it cheap: an e4m3 byte u of 0..15 is u * 2^-9 exactly
(bits 0..7 are the subnormals u * 2^-9, bits 8..15 the first normal binade, (8 + m) * 2^-9: one ulp for both), so the
unsigned code itself is the operand. With u the stored code q (a zero-point scheme) or c ^ 8 = c + 8 (a symmetric
two's-complement code c), the product wanted is

    sum_k a_k (u_k - z) = 2^9 sum_k a_k (u_k 2^-9) - z sum_k a_k,

so each 128-wide K step's fp32 partial is scaled by its group's scales as the channel-group kernels scale theirs, and
the zero point's share, z * s * (the group's sum of activation codes), is taken off once after the loop in one small
product (`group_sums`, in bf16 heads and tails on the tensor cores). Tiles, expert lookup and masking are `gemm_grouped_tma`'s; a
dense product is one expert owning every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fxquant.kernels.cast import capability, float_cast_mode, interpreting
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL, channel_scales
from fxquant.kernels.launch import cdiv, visible
from fxquant.kernels.tiles import expert_k_steps, expert_tile_offsets, store_tile

GROUP = 128  # one weight group a K step
CODE_ULP = tl.constexpr(2.0**-9)  # the value of e4m3 byte 1: e4m3 bytes 0..15 are 0..15 times it
SYMMETRIC_ZERO = tl.constexpr(8.0)  # c ^ 8 = c + 8 for a 4-bit two's-complement c
CORRECTION_GROUPS = 32  # groups per step of the zero points' product after the loop

# Outputs $0 and $1: the low and the high nibbles of word $2's four bytes, each in its own byte, XORed with FLIP
# (one lop3 each: (x & 0x0f0f0f0f) ^ FLIP).
_NIBBLES_ASM = """
{
.reg .b32 t;
lop3.b32 $0, $2, 0x0f0f0f0f, FLIP, 0x6a;
shr.u32 t, $2, 4;
lop3.b32 $1, t, 0x0f0f0f0f, FLIP, 0x6a;
}
"""
_NIBBLES_SYMMETRIC = tl.constexpr(_NIBBLES_ASM.replace("FLIP", "0x08080808"))
_NIBBLES_UNSIGNED = tl.constexpr(_NIBBLES_ASM.replace("FLIP", "0x00000000"))


@triton.jit
def codes_as_e4m3(packed, SYMMETRIC: tl.constexpr, PTX: tl.constexpr):
    """[R, W] bytes of packed codes (code 2j in byte j's low nibble, 2j + 1 in its high one) as [R, 2W] e4m3 in K
    order whose bits are the unsigned codes u (c ^ 8 where SYMMETRIC), each worth u * 2^-9 exactly. PTX: four bytes
    at a time in a register (the GPU); else byte by byte (the interpreter, which runs no PTX), to the same bits."""
    if PTX:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_SYMMETRIC if SYMMETRIC else _NIBBLES_UNSIGNED, "=r,=r,r",
                                           [packed], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
    else:
        flip = 8 if SYMMETRIC else 0
        lo, hi = ((packed & 15) ^ flip).to(tl.uint8), ((packed >> 4) ^ flip).to(tl.uint8)
    codes = tl.reshape(tl.join(lo, hi), (packed.shape[0], packed.shape[1] * 2))
    return codes.to(tl.float8e4nv, bitcast=True)


@triton.jit
def split_bf16_dot(x, y, acc, SPLIT: tl.constexpr):
    """acc + x @ y.T for fp32 x [R, G] and y [C, G]. SPLIT (the GPU): each split into a bf16 head and a bf16 tail (16
    significant bits together), three bf16 MMAs, the tail x tail term dropped, about 2^-16 of each product: the
    correction it computes is of the product's own size, so it needs more than one bf16's 8 bits, not fp32's 24.
    Else (the interpreter, whose 16-bit dots are wrong) one fp32 product."""
    if not SPLIT:
        return tl.dot(x, tl.trans(y), acc, input_precision="ieee")
    x_hi = x.to(tl.bfloat16)
    y_hi = y.to(tl.bfloat16)
    x_lo = (x - x_hi.to(tl.float32)).to(tl.bfloat16)
    y_lo = (y - y_hi.to(tl.float32)).to(tl.bfloat16)
    acc = tl.dot(x_lo, tl.trans(y_hi), acc)
    acc = tl.dot(x_hi, tl.trans(y_lo), acc)
    return tl.dot(x_hi, tl.trans(y_hi), acc)


@triton.jit
def _int4_fp8_tma_kernel(
    # descriptors and pointers
    a_desc, w_desc, offs_ptr, c_ptr, a_scale_ptr, a_sums_ptr, w_scale_ptr, w_zero_ptr, bias_ptr,
    # sizes
    M, N, K, E,
    # strides (zero points share the scales' layout)
    stride_cm, stride_asm, stride_sums, stride_se, stride_sn,
    # meta-parameters
    HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, PTX: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, CORRECTION_GROUPS: tl.constexpr,
):
    BLOCK_K: tl.constexpr = 128
    expert, pid_n, offs_m, offs_n = expert_tile_offsets(offs_ptr, E, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    owned, e, first_k, last_k = expert_k_steps(expert, E, K, BLOCK_K, 1)
    first_row = tl.min(offs_m, axis=0)  # the tile's first row of its expert; M where it owns none
    weight_row = (e * N + pid_n * BLOCK_N).to(tl.int32)  # a descriptor's coordinates are int32
    w_scale_ptr += e * stride_se
    w_zero_ptr += e * stride_se
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first_k, last_k):
        a = a_desc.load([first_row, k * BLOCK_K])  # [BM, BK]; rows past M read as zeros
        w = codes_as_e4m3(w_desc.load([weight_row, k * (BLOCK_K // 2)]), not HAS_ZP, PTX)  # [BN, BK]
        # Each group's fp32 partial scaled before it joins the accumulator: the fp8 MMA's own accumulator keeps fewer
        # bits (docs/decisions/0002).
        acc += tl.dot(a, tl.trans(w)) * channel_scales(w_scale_ptr, offs_n, mask_n, k, stride_sn, 1)[None, :]
    # Less each group's z * s * 2^-9 * sum(a) (the partials were of u * 2^-9), then the token's scale times 2^9.
    for g0 in range(first_k, last_k, CORRECTION_GROUPS):
        g = g0 + tl.arange(0, CORRECTION_GROUPS)
        in_k = g < last_k
        sums = tl.load(a_sums_ptr + offs_m[:, None] * stride_sums + g[None, :], mask=mask_m[:, None] & in_k[None, :],
                       other=0.0)
        zs = tl.load(w_scale_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_n[:, None] & in_k[None, :],
                     other=0.0)
        if HAS_ZP:
            zs *= tl.load(w_zero_ptr + offs_n[:, None] * stride_sn + g[None, :], mask=mask_n[:, None] & in_k[None, :],
                          other=0).to(tl.float32)
        else:
            zs *= SYMMETRIC_ZERO
        acc = split_bf16_dot(-sums, zs * CODE_ULP, acc, PTX)
    acc *= tl.load(a_scale_ptr + offs_m * stride_asm, mask=mask_m, other=0.0)[:, None] * (1.0 / CODE_ULP)
    acc = tl.where(owned, acc, 0.0)  # a non-finite scale of the clamped expert must not reach the zero rows
    store_tile(acc, c_ptr, c_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, 1, 0, HAS_BIAS, 1, OUT, CAST)


@triton.jit
def _group_sums_kernel(a_ptr, out_ptr, M, stride_am, stride_om, BLOCK_M: tl.constexpr, GROUP: tl.constexpr):
    """out[m, g]: the sum of row m's e4m3 codes in group g, in fp32."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    mask = offs_m < M
    codes = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + g * GROUP + tl.arange(0, GROUP)[None, :],
                    mask=mask[:, None], other=0.0)
    tl.store(out_ptr + offs_m * stride_om + g, tl.sum(codes.to(tl.float32), axis=1), mask=mask)


def group_sums(a: torch.Tensor) -> torch.Tensor:
    """[M, K] e4m3 codes (K a multiple of 128) as [M, K/128] fp32 sums of each row's codes per 128-wide group: the
    zero point's share of a W4A8 product over unsigned codes."""
    M, K = a.shape
    out = torch.empty((M, K // GROUP), dtype=torch.float32, device=a.device)
    if M:
        block_m = 32
        visible(_group_sums_kernel)[(cdiv(M, block_m), K // GROUP)](a, out, M, a.stride(0), out.stride(0),
                                                                   BLOCK_M=block_m, GROUP=GROUP)
    return out


# The channel-group tiles of the grouped fp8 kernel through TMA (decision 0038), which this kernel's loop is plus the
# decoding: 128x128 on 8 warps, 4 stages.
TILES = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)


def supports(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel can read a [M, K] and the experts' packed codes w [E, N, K/2]: a Hopper GPU (or the
    interpreter) and tensor descriptors over both (K contiguous, the experts one [E * N, K/2] matrix, row strides
    and base addresses multiples of 16 bytes)."""
    hopper = interpreting(_int4_fp8_tma_kernel) or (a.is_cuda and capability(a.device) >= (9, 0))
    E, N, half_k = w.shape
    stacked = w.stride(0) == N * w.stride(1)
    return hopper and stacked and all(t.stride(-1) == 1 and t.stride(-2) % 16 == 0 and t.data_ptr() % 16 == 0
                                      for t in (a, w))


def int4_fp8_tma(out, a, a_scale, offs, w, w_scale, zero_point, grid_rows: int, meta: dict, bias=None):
    """W4A8 over rows sorted by expert into `out` [M, N]: a [M, K] e4m3 with per-token scales [M, 1]; offs: int32
    [E]; w: [E, N, K/2] packed int4 codes (uint8) with scales [E, N, K/128] fp32 and zero points like them, or None
    (symmetric codes); bias: [N] (one expert) or None. grid_rows: row tiles to launch (the worst case over the
    routing); meta: the tiles (BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages)."""
    (M, K), (E, N) = a.shape, w.shape[:2]
    bm, bn = meta["BLOCK_M"], meta["BLOCK_N"]
    codes = w.view(torch.uint8)
    scale = w_scale.contiguous()
    zero = zero_point.contiguous() if zero_point is not None else scale
    sums = group_sums(a)
    visible(_int4_fp8_tma_kernel)[(grid_rows * cdiv(N, bn),)](
        TensorDescriptor.from_tensor(a, [bm, GROUP]),
        TensorDescriptor.from_tensor(codes.view(E * N, K // 2), [bn, GROUP // 2]),
        offs, out, a_scale.reshape(-1), sums, scale, zero, bias if bias is not None else scale, M, N, K, E,
        out.stride(0), a_scale.reshape(-1).stride(0), sums.stride(0), scale.stride(0), scale.stride(1),
        HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None, PTX=not interpreting(_int4_fp8_tma_kernel),
        OUT=TORCH_TO_TL[out.dtype], CAST=float_cast_mode(_int4_fp8_tma_kernel), BLOCK_M=bm, BLOCK_N=bn,
        GROUP_M=meta["GROUP_M"], CORRECTION_GROUPS=CORRECTION_GROUPS, num_warps=meta["num_warps"],
        num_stages=meta["num_stages"],
    )
    return out
