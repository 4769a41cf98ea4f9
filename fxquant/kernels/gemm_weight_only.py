"""Weight-only GEMMs: out[M, N] = A[M, K] (bf16/fp16) @ dequantize(W)[N, K].T (+ bias), fp32 accumulation.

The weight is dequantized in registers, tile by tile; no full-precision copy of it ever exists. Each code is
turned into a value the activation dtype holds exactly, so the tensor cores multiply exact operands:
- int8 per channel: the integer code; the channel scale is applied once in the epilogue;
- int4, groups of 128 along K, with zero point: (q - z) times its group's fp32 scale, rounded once to the
  activation dtype (the one inexact operand: 2^-9 relative in bf16, far below int4's own step);
- MXFP4: the e2m1 value times its block's power-of-two E8M0 scale (exact: 2 significant bits);
- NVFP4: the e2m1 value times its block's e4m3 scale (exact: at most 6 significant bits); the fp32 global
  scale is applied in the epilogue.
Packed 4-bit weights hold K-pairs per byte (low nibble first); the kernel loads them [N, K/2] and interleaves
the nibbles back into K order in registers.
Small M splits K across programs (`splitk.py`). K and N tails are masked. Under Triton's interpreter, whose
bf16 dot is wrong, the dot runs in fp32 on the same exact operands.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import float_cast_mode, interpreting
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.splitk import TARGET_PROGRAMS, reduce_partials, split_k
from fxquant.kernels.tiles import grouped_tile, k_steps_of, store_tile

FORMATS = {"int8": 0, "int4": 1, "mxfp4": 2, "nvfp4": 3}
E8M0_MIN = tl.constexpr(2.0**-127)  # E8M0 code 0: the one scale whose fp32 value is subnormal
TWO_POW_23 = tl.constexpr(8388608.0)  # fp32 2^23 has an ulp of 1: its low mantissa bits hold small integers
E2M1_TWICE = tl.constexpr(-932957680)  # 0xC8643210: nibble n is 2|e2m1(n)| for n = 0..7 (0, 1, 2, 3, 4, 6, 8, 12)


@triton.jit
def _biased(n):
    """2^23 + n as fp32, exactly, for 0 <= n < 2^23: n ORed into 2^23's mantissa. Subtracting a biased integer
    gives an exact difference without an int -> float conversion, which issues at a quarter of the FMA rate."""
    return (n | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_twice(code):
    """A 4-bit e2m1 code (sign in bit 3) as fp32 twice its value: a table lookup in one int32 constant."""
    twice = (E2M1_TWICE >> ((code & 7) * 4)) & 15
    magnitude = (_biased(twice) - TWO_POW_23).to(tl.int32, bitcast=True)
    return (magnitude | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _block_scale(s_ptr, offs_n, k_index, stride_sn, stride_sk, mask, FMT: tl.constexpr):
    """The per-(n, k-block) scales as fp32, from E8M0 (MXFP4) or e4m3 (NVFP4) codes."""
    raw = tl.load(s_ptr + offs_n * stride_sn + k_index * stride_sk, mask=mask, other=0)
    if FMT == 2:
        e = raw.to(tl.int32)
        value = (e << 23).to(tl.float32, bitcast=True)
        return tl.where(e == 0, E8M0_MIN, tl.where(e == 255, float("nan"), value))
    return raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _nibbles(w_ptr, offs_n, mask_n, step, K, stride_wn, stride_wk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             UNPACK: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] 4-bit codes of one K step, in K order, as int32 (byte p holds k = 2p in its low
    nibble and 2p + 1 in its high one)."""
    if UNPACK == 0:  # load each byte once, interleave its nibbles in registers
        HALF: tl.constexpr = BLOCK_K // 2
        pair = step * HALF + tl.arange(0, HALF)
        packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + pair[None, :] * stride_wk,
                         mask=mask_n[:, None] & (2 * pair[None, :] < K), other=0).to(tl.int32)
        return tl.interleave(packed & 15, packed >> 4)
    else:  # load each byte for both of its k, shift by the k's parity
        k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        packed = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k // 2)[None, :] * stride_wk,
                         mask=mask_n[:, None] & (k[None, :] < K), other=0).to(tl.int32)
        return (packed >> ((k & 1) * 4)[None, :]) & 15


@triton.jit
def _wo_gemm_kernel(
    # pointers
    a_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, c_ptr, ws_ptr, bias_ptr,
    # sizes
    M, N, K,
    # strides (the weight's in bytes of its packed rows)
    stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk, stride_cm, stride_cn,
    # meta-parameters
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    DOT: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, SWAP_AB: tl.constexpr, UNPACK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    if SWAP_AB:  # out.T = W @ A.T: N fills the MMA's M side and the dequantized W can feed it from registers
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_k, last_k):
        k = step * BLOCK_K + offs_k
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak,
                    mask=mask_m[:, None] & (k[None, :] < K), other=0.0).to(DOT)  # [BM, BK]
        if FMT == 0:  # uint8 view of the int8 codes: c + 128 = u ^ 0x80, biased then unbiased exactly
            u = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                        mask=mask_n[:, None] & (k[None, :] < K), other=128).to(tl.int32)
            w = (_biased(u ^ 0x80) - (TWO_POW_23 + 128.0)).to(DOT)
        else:
            codes = _nibbles(w_ptr, offs_n, mask_n, step, K, stride_wn, stride_wk, BLOCK_N, BLOCK_K, UNPACK)
            if FMT == 1:
                s_index = step * BLOCK_K // GROUP  # BLOCK_K divides GROUP: one group per K step
                scale = tl.load(s_ptr + offs_n * stride_sn + s_index * stride_sk, mask=mask_n, other=0.0)
                if HAS_ZP:
                    z = tl.load(z_ptr + offs_n * stride_sn + s_index * stride_sk, mask=mask_n, other=0)
                    ints = _biased(codes) - (z.to(tl.float32) + TWO_POW_23)[:, None]  # q - z, exact
                else:  # symmetric two's-complement nibble: (c ^ 8) - 8
                    ints = _biased(codes ^ 8) - (TWO_POW_23 + 8.0)
                # (q - z) * s rounded once to the activation dtype (2^-9 relative in bf16, ~60x finer than the
                # int4 step), so every K step chains into one MMA accumulator.
                w = (ints * scale[:, None]).to(DOT)
            else:
                BLOCKS: tl.constexpr = BLOCK_K // GROUP  # scale blocks per K step (BLOCK_K is a multiple of 16, 32)
                offs_b = step * BLOCKS + tl.arange(0, BLOCKS)
                scale = _block_scale(s_ptr, offs_n[:, None], offs_b[None, :], stride_sn, stride_sk,
                                     mask_n[:, None] & (offs_b[None, :] * GROUP < K), FMT)  # [BN, BLOCKS]
                # twice the e2m1 value times half the scale: both exact (a power-of-two shift)
                values = tl.reshape(_e2m1_twice(codes), (BLOCK_N, BLOCKS, GROUP)) * (scale * 0.5)[:, :, None]
                w = tl.reshape(values, (BLOCK_N, BLOCK_K)).to(DOT)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]
    if FMT == 3:
        acc = acc * tl.load(gs_ptr)
    store_tile(acc, c_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, pid_k,
               HAS_BIAS, SPLIT_K, OUT, CAST)


def wo_gemm_config(M: int) -> dict:
    """Tiles by M bucket, chosen by reasoning, not yet swept on the H200: decode streams the weight with narrow N
    tiles (and split-K); larger M reuses tiles. BLOCK_K divides int4's group of 128 and is a multiple of every
    4-bit block (16, 32)."""
    if M <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP_AB=False,
                    UNPACK=0, programs=TARGET_PROGRAMS)
    if M <= 128:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4, SWAP_AB=False,
                    UNPACK=0, programs=TARGET_PROGRAMS)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SWAP_AB=False,
                UNPACK=0, programs=TARGET_PROGRAMS)


def weight_only_mm(a, w, w_scale, fmt: str, group: int, N: int, *, zero_point=None, global_scale=None,
                   bias=None, config=None):
    """a: [M, K] bf16/fp16; w: the codes as `fxquant.quantize` packs them ([N, K] int8, or [N, K/2] uint8);
    w_scale: [N, 1] (int8), [N, K/group] fp32 (int4), E8M0 (mxfp4) or e4m3 (nvfp4). Returns [M, N] in a's dtype."""
    M, K = a.shape
    if fmt not in FORMATS or a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fxquant: weight-only GEMM takes bf16/fp16 activations and one of {list(FORMATS)}; got "
                         f"{a.dtype} and {fmt!r}")
    packed = fmt != "int8"
    if w.shape != (N, K // 2 if packed else K) or (packed and K % 2):
        raise ValueError(f"fxquant: {fmt} weight codes must be [N={N}, K{'/2' if packed else ''}] for a [M, K={K}], "
                         f"got {tuple(w.shape)}")
    cfg = config or wo_gemm_config(M)
    if fmt == "int4" and group % cfg["BLOCK_K"]:
        raise ValueError(f"fxquant: int4 groups of {group} need BLOCK_K dividing them, got {cfg['BLOCK_K']}")
    scale = w_scale.view(torch.uint8) if fmt in ("mxfp4", "nvfp4") else w_scale
    scale = scale.reshape(N, -1)
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    split = split_k(tiles, triton.cdiv(K, cfg["BLOCK_K"]), M, cfg["programs"])
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    codes = w.view(torch.uint8) if fmt == "int8" else w  # int8 codes are read as bytes and unbiased exactly
    _wo_gemm_kernel[(tiles, split)](
        a, codes, scale, zero_point if zero_point is not None else scale,
        global_scale if global_scale is not None else scale, out, ws, bias if bias is not None else out,
        M, N, K,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        FMT=FORMATS[fmt], GROUP=group or 1, HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None,
        SPLIT_K=split, DOT=tl.float32 if interpreting(_wo_gemm_kernel) else TORCH_TO_TL[a.dtype],
        OUT=TORCH_TO_TL[a.dtype], CAST=float_cast_mode(_wo_gemm_kernel), SWAP_AB=cfg["SWAP_AB"],
        UNPACK=cfg["UNPACK"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if split > 1:
        reduce_partials(ws, out, bias, TORCH_TO_TL[a.dtype])
    return out
