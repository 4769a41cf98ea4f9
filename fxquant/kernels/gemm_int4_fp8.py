"""W4A8: out[M, N] = (A[M, K] * a_scale) @ (W[N, K] * w_scale).T (+ bias), with e4m3 activations and int4 weights.

Each int4 code, less its group's zero point (-15..15), or sign-extended where the scheme has none (-8..7), is an
integer e4m3 holds exactly, and so does fp16, which holds every e4m3 value too. Up to 128 rows the kernel multiplies
both in fp16 (the fp16 MMA, fp32 accumulation): sm_90's mma.sync takes e4m3 only by converting it to fp16 first, and
the codes become fp16 integers from bits in two instructions a pair, where making them e4m3 took a conversion and a
cast each. One K step is one weight group (128): its fp32 partial sum takes the group's scales [N] before it joins the
fp32 accumulator, and the per-token activation scales [M] multiply the tile once at the end, since they are constant
along K.

The kernel decodes each K step's 16 words of codes per weight row in registers; at decode its K is split across programs
(`splitk.py`). The codes may be rows [N, K / 2] or `code_tiles`' tiles, as the backend holds them on the GPU (one group
of 64 rows is one 4 KB run there); both kernels read either. Tiles come from `int4_fp8_config`, from
`bench/int4_fp8_gemm.py --sweep` on an H200. Past M = 128 a second route makes the codes e4m3 integers once per call and
multiplies them on the fp8 tensor cores (`cublas_int4_fp8`): where the group scales are each a power of two times a row
scale (int4_fp8's quantizer makes them so, numerics/row_powers_of_two.py), the codes take their groups' powers of two
and cuBLAS's rowwise GEMM scales each fp32 sum once; otherwise cuBLAS's 1x128-by-1x128 block-scaled GEMM scales each
group's partial.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_fp8, cast_mode, interpreting
from fxquant.kernels.code_tiles import code_rows, is_tiled, tiled_shape, tiled_words
from fxquant.kernels.codes import biased, dot_operands, e4m3_words, int4_integers, packed_words
from fxquant.kernels.cublas_fp8 import block_scaled_rows, cublas_scaled_mm
from fxquant.kernels.dependent_launch import launch_options, wait_for_previous
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, visible
from fxquant.kernels.splitk import TARGET_PROGRAMS, counters, reduce_partials, split_k, sum_if_last_slice
from fxquant.kernels.tiles import k_steps_of, store_tile, tile_offsets

GROUP = 128  # the only weight group these kernels take: one group per K step
SYMMETRIC_BIAS = tl.constexpr(8388616.0)  # 2^23 + 8: biased(q ^ 8) less it is the sign-extended nibble q
CUBLAS_ABOVE_M = 128  # the rows past which cuBLAS takes the product (docs/decisions/0017)


def int4_fp8_config(M: int, N: int) -> dict:
    """Tiles for an [M, K] x [N, K] W4A8 product, and past M = 128 the cuBLAS route where it takes the product."""
    if M <= 16:
        # `--sweep --ms 1 16` at 56002f8 (int4_fp8_gemm_sweep_small_56002f8.txt): split K 8 ways with 128-wide tiles
        # won on every shape measured, 12.6 -> 10.7 us on 4096x4096, 31.9 -> 26.8 on 14336x4096 and 34.2 -> 26.5 on
        # 4096x14336 at M = 1 (1.13-1.26x bf16 cuBLAS): the narrow weights reach 8 slices at 264 programs (16 were
        # slower at K = 14336), the wide ones at 1056.
        # K meets in codes.pair_order here: 414 -> 382 instructions a K step on sm_90 (`python -m bench.sass w4a8`),
        # and faster than K order on every Llama shape (`--pair-order`, H100 at 1ef4406, w4a8_pairs_1ef4406.txt: M = 1
        # 10.2 / 27.4 / 25.7 us against 13.5 / 33.5 / 34.2), unlike the weight-only GEMMs; on the 64-row tiles below
        # K order keeps 220 registers where pair order takes 254.
        return dict(BLOCK_M=16, BLOCK_N=128, GROUP_M=1, num_warps=4, num_stages=3,
                    programs=TARGET_PROGRAMS if N <= 4096 else 4 * TARGET_PROGRAMS, PAIR_ORDER=True)
    if M <= CUBLAS_ABOVE_M:
        return dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4, PAIR_ORDER=False)
    # At M = 1024 and 4096 on the Llama shapes cuBLAS ran at 1.05-1.09x and 1.23-1.27x bf16 cuBLAS, the kernel's best
    # tiles (these) at 0.44-0.50x: its per-group scaling and decoding stall the MMA
    # (docs/decisions/0017-w4a8-past-m128-on-cublas-block-scales.md).
    return dict(CUBLAS=True, BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=3)


def cublas_supports(a: torch.Tensor, N: int, bias, out_dtype: torch.dtype) -> str | None:
    """Why the cuBLAS route does not take an [M, K] x [N, K] product, or None where it does."""
    if not a.is_cuda:
        return "cuBLAS runs on CUDA devices"
    if a.shape[0] <= CUBLAS_ABOVE_M:
        return f"M = {a.shape[0]}: the kernel serves up to {CUBLAS_ABOVE_M} rows"
    if bias is not None or out_dtype != torch.bfloat16:
        return "a bias or an output other than bf16: cuBLAS would round the product before the bias is added"
    if N % 16:
        return f"N = {N}: cuBLAS's fp8 GEMM takes multiples of 16"
    return None


def supports(a: torch.Tensor, group: int, out_dtype: torch.dtype) -> str | None:
    """Why these kernels cannot compute the product, or None where they can."""
    if not a.is_cuda:
        return "it runs on CUDA devices (the CPU takes the reference)"
    return shape_refusal(a.shape[-1], group, out_dtype)


def shape_refusal(K: int, group: int, out_dtype: torch.dtype) -> str | None:
    """What in the product's K, weight group and output dtype alone keeps the kernel from it on a GPU, or None."""
    if group != GROUP:
        return f"its weight groups are {GROUP} wide, not {group}"
    if K % GROUP:
        return f"K = {K} is not a multiple of its group, {GROUP}"
    if out_dtype not in TORCH_TO_TL:
        return f"it writes bf16, fp16 or fp32, not {out_dtype}"
    return None


@triton.jit
def e4m3_codes(packed, zero, HAS_ZP: tl.constexpr, CAST: tl.constexpr, shift):
    """[BLOCK_N, GROUP / 2] bytes of packed codes (code 2j in byte j's low nibble, 2j + 1 in its high one) as the
    [BLOCK_N, GROUP] e4m3 integers q - z (or the sign-extended q), in K order, times shift [BLOCK_N] (powers of two)
    where it is not None. Each difference is made exactly in fp32 from biased integers, with no int -> float
    conversion, and is small enough that the cast is exact."""
    b = packed.to(tl.int32)
    codes = tl.reshape(tl.join(b & 15, b >> 4), (b.shape[0], b.shape[1] * 2))
    if HAS_ZP:
        values = biased(codes) - biased(zero)[:, None]
    else:
        values = biased(codes ^ 8) - SYMMETRIC_BIAS
    if shift is not None:
        values = values * shift[:, None]
    return cast_fp8(values, tl.float8e4nv, CAST)


@triton.jit
def group_zeros(w_zero_ptr, offs_n, mask_n, g, stride_sn, HAS_ZP: tl.constexpr):
    """Group g's zero points [BLOCK_N] as int32 (0 where the scheme has none)."""
    if HAS_ZP:
        return tl.load(w_zero_ptr + offs_n * stride_sn + g, mask=mask_n, other=0).to(tl.int32)
    return tl.zeros(offs_n.shape, tl.int32)


@triton.jit
def int4_fp8_accumulate(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, offs_m, offs_n, M, N, K, first, last,
                        stride_am, stride_wn, stride_sn, HAS_ZP: tl.constexpr, DOT: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIR_ORDER: tl.constexpr,
                        TILED: tl.constexpr):
    """The fp32 tile (A[offs_m] * a_scale) @ (W[offs_n] * w_scale).T over weight groups [first, last); a_ptr and w_ptr:
    int32 words of four activation codes and of eight weight codes (strides in words; TILED: the codes are `code_tiles`'
    tiles of a weight K codes wide). Each e4m3 activation and each q - z is exact in fp16 (DOT on the GPU), where
    sm_90's mma.sync multiplies fp8 operands anyway, after converting them: the codes become q - z two at a time from
    bits (`codes.int4_integers`), the activations fp16 two at a time (`codes.e4m3_words`); PAIR_ORDER: K meets in
    `codes.pair_order`. Compiled for sm_90 at the decode tile (`python -m bench.sass w4a8`, Triton 3.8) a K step takes
    367 instructions a thread and 128 registers (382 before fp16's decode took one shift a code word), where the codes
    made e4m3 through fp32 and the bit-exact cast, then widened with the activations, took 816 and 168; at the 64-row
    tile 507 against 801 (before that change), on fp16 wgmma where fp8 wgmma ran, whose accumulator keeps fewer bits
    (docs/decisions/0002)."""
    offs_w = tl.arange(0, GROUP // 4)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + first * (GROUP // 4) + offs_w[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, last):
        a = e4m3_words(tl.load(a_ptrs, mask=mask_m[:, None], other=0), DOT)  # [BM, GROUP], exact
        packed = packed_words(w_ptr, offs_n, mask_n, g, K, stride_wn, GROUP, True, TILED)  # [BN, GROUP / 8] words
        ints = int4_integers(packed, w_zero_ptr, offs_n, mask_n, g, stride_sn, 1, HAS_ZP, DOT)
        scale = tl.load(w_scale_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0)
        # The group's partial in fp32, scaled, then added: the MMA's short accumulator spans one group only.
        x, w = dot_operands(a, ints, PAIR_ORDER)
        acc += tl.dot(x, w) * scale[None, :]
        a_ptrs += GROUP // 4
    # The token's scale is linear: each K slice applies it to its own partial before they are summed.
    return acc * tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]


@triton.jit
def _int4_fp8_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
                     M, N, K, stride_am, stride_wn, stride_sn, stride_om,
                     HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr,
                     SPLIT_K: tl.constexpr, LAST_SLICE_SUMS: tl.constexpr, GROUP: tl.constexpr, DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
                     PAIR_ORDER: tl.constexpr, TILED: tl.constexpr):
    wait_for_previous(PDL)
    pid_m, pid_n, offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    first, last = k_steps_of(pid_k, K, GROUP, SPLIT_K)  # this program's groups
    acc = int4_fp8_accumulate(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, w_zero_ptr, offs_m, offs_n, M, N, K, first,
                              last, stride_am, stride_wn, stride_sn, HAS_ZP, DOT, GROUP, BLOCK_M, BLOCK_N, PAIR_ORDER,
                              TILED)
    store_tile(acc, out_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, stride_om, 1, pid_k, HAS_BIAS, SPLIT_K, OUT,
               CAST)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, out_ptr, bias_ptr, counter_ptr, tl.program_id(0), offs_m, offs_n, M, N, stride_om,
                          1, HAS_BIAS, SPLIT_K, OUT, CAST)


@triton.jit
def power_of_two_ratio(scale, row):
    """scale / row where both are normal fp32 with one mantissa (the row-scaled form), exactly, from their exponent
    bits (a division could round); NaN where scale is NaN (a poisoned group stays poisoned)."""
    bits = scale.to(tl.int32, bitcast=True) - row.to(tl.int32, bitcast=True) + (127 << 23)
    return tl.where(scale == scale, bits.to(tl.float32, bitcast=True), float("nan"))


@triton.jit
def _int4_e4m3_kernel(w_ptr, w_zero_ptr, scale_ptr, row_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se,
                      stride_sn, stride_re, stride_rn, stride_oe, stride_on, HAS_ZP: tl.constexpr, ROWS: tl.constexpr,
                      CAST: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr):
    """One weight group's codes for BLOCK_N rows of one expert (axis 2), written as their e4m3 integers; ROWS: each
    times its group's scale over its row's, a power of two that keeps it exact (numerics/row_powers_of_two.py).
    TILED: the codes are one weight's `code_tiles` tiles, whose group of 64 rows is one run of memory."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    w_ptr += e * stride_we
    w_zero_ptr += e * stride_se
    out_ptr += e * stride_oe
    mask_n = offs_n < N
    byte = g * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
    if TILED:  # a row's bytes of a group lie in its tile in their order, four to an int32 word
        offsets = tiled_words(offs_n[:, None], byte // 4, K) * 4 + byte % 4
    else:
        offsets = offs_n[:, None].to(tl.int64) * stride_wn + byte
    packed = tl.load(w_ptr + offsets, mask=mask_n[:, None], other=0)
    zeros = group_zeros(w_zero_ptr, offs_n, mask_n, g, stride_sn, HAS_ZP)
    if ROWS:
        group_scale = tl.load(scale_ptr + e * stride_se + offs_n * stride_sn + g, mask=mask_n, other=1.0)
        row_scale = tl.load(row_ptr + e * stride_re + offs_n * stride_rn, mask=mask_n, other=1.0)
        w8 = e4m3_codes(packed, zeros, HAS_ZP, CAST, power_of_two_ratio(group_scale, row_scale))
    else:
        w8 = e4m3_codes(packed, zeros, HAS_ZP, CAST, None)
    tl.store(out_ptr + offs_n[:, None].to(tl.int64) * stride_on + g * GROUP + tl.arange(0, GROUP)[None, :], w8,
             mask=mask_n[:, None])


def int4_as_e4m3(w: torch.Tensor, zero_point: torch.Tensor | None, scale: torch.Tensor | None = None,
                 row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K/2] packed int4 codes (zero points [N, K/128], or None: symmetric), or their tiles (`code_tiles`), or
    [E, N, K/2] of experts (zero points [E, N, K/128]; a slice of rows of each is fine), as the contiguous [N, K]
    ([E, N, K]) e4m3 integers q - z, exactly: the weight cuBLAS or the grouped fp8 kernel multiplies with per-group
    scales. Given the group scales [(E,) N, K/128] and row scales [(E,) N, 1] of the row-scaled form
    (numerics/row_powers_of_two.py), each is times its group's power of two instead, exactly: the weight a
    row-scaled GEMM multiplies with row_scale."""
    experts, tiled = w.dim() == 3, is_tiled(w)
    lift = lambda t: None if t is None else _k_contiguous(t if experts else t.unsqueeze(0))
    zero3, scale3, row3 = lift(zero_point), lift(scale), lift(row_scale)
    if tiled:  # one weight: E = 1, and the tiles addressed whole (their strides unread)
        (E, N), K = (1, code_rows(w)), w.shape[1] * 2 * w.shape[3]
        w3 = w.contiguous().view(1, N, K // 2)
    else:
        w3 = lift(w)
        (E, N), K = w3.shape[:2], w3.shape[2] * 2
    out = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    groups = next((t for t in (zero3, scale3) if t is not None), out)  # the group grids share their strides
    if zero3 is not None and scale3 is not None and zero3.stride() != scale3.stride():
        raise ValueError("fxquant: int4 zero points and group scales must share one layout")
    rows = row3 if row3 is not None else out
    block_n = 64
    visible(_int4_e4m3_kernel)[(cdiv(N, block_n), K // GROUP, E)](
        w3, zero3 if zero3 is not None else groups, scale3 if scale3 is not None else groups, rows, out, N, K,
        w3.stride(0), w3.stride(1), groups.stride(0), groups.stride(1), rows.stride(0), rows.stride(1), out.stride(0),
        out.stride(1),
        HAS_ZP=zero_point is not None, ROWS=row_scale is not None, CAST=cast_mode(_int4_e4m3_kernel, w.device),
        GROUP=GROUP, BLOCK_N=block_n, TILED=tiled)
    return out if experts else out[0]


def _k_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with its last (K) dimension contiguous, copied only where it is not: slices of rows stay views."""
    return t if t.stride(-1) == 1 else t.contiguous()


def cublas_int4_fp8(a, a_scale, w, w_scale, zero_point, row_scale=None) -> torch.Tensor:
    """The product through cuBLAS's fp8 GEMM, bf16 out, the codes made e4m3 for the call (twice the int4 codes'
    bytes, read once by cuBLAS). Given row scales [N, 1] of the row-scaled form (numerics/row_powers_of_two.py), the
    codes take their groups' powers of two and cuBLAS's rowwise GEMM scales the fp32 sum by the token's scale and the
    row's (docs/decisions/0040-w4a8-row-scaled-past-m128.md); otherwise its 1x128-by-1x128 block-scaled GEMM scales
    each group's partial by the token's scale and the group's, in fp32 (the same sum as the kernel's)."""
    (M, K), N = a.shape, w.shape[0]
    if row_scale is not None:
        w8 = int4_as_e4m3(w, zero_point, w_scale, row_scale)
        # a fresh copy of the tokens' scales: cuBLAS refused a slice's (an expert's rows, H100: 984 rows at offset)
        return cublas_scaled_mm(a, a_scale.reshape(M, 1).clone(), w8, row_scale.reshape(N), block_scales=False)
    w8 = int4_as_e4m3(w, zero_point)
    a, sa = block_scaled_rows(a, a_scale.reshape(M, 1).expand(M, K // GROUP))  # the token's scale in each group
    sw = w_scale.t().contiguous()  # [K/128, N], N-major: cuBLAS wants both scale grids outer-dimension-major
    return torch._scaled_mm(a, w8.t(), sa, sw, out_dtype=torch.bfloat16)[:M]


def as_words(a: torch.Tensor) -> torch.Tensor:
    """Contiguous [M, K] e4m3 codes (K a multiple of 4) as [M, K / 4] int32 words, copied first where a view starts
    off a 4-byte boundary."""
    return (a if a.storage_offset() % 4 == 0 else a.clone()).view(torch.int32)


def dot_type(kernel):
    """The products' dtype: fp16 on the GPU; fp32 under Triton's interpreter, whose 16-bit dots are wrong (both hold
    the operands exactly)."""
    return tl.float32 if interpreting(kernel) else tl.float16


def int4_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                zero_point: torch.Tensor | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
                config: dict | None = None, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """a: [M, K] e4m3 codes with a_scale [M, 1] (per token); w: [N, K/2] packed int4 codes, or their tiles
    (`code_tiles`), with w_scale [N, K/128] fp32 and zero_point [N, K/128] uint8 (or None: symmetric codes).
    Returns [M, N] in out_dtype. config: tiles (and CUBLAS) replacing `int4_fp8_config`'s (a sweep's). row_scale:
    [N, 1] where w_scale is in the row-scaled form (numerics/row_powers_of_two.py), which the cuBLAS route multiplies
    row-scaled; the kernel reads w_scale."""
    M, K = a.shape
    N, tiled = code_rows(w), is_tiled(w)
    stored = tiled_shape(N, K) if tiled else (N, K // 2)
    if w.shape != stored or w_scale.shape != (N, K // GROUP):
        raise ValueError(f"fxquant: int4 x fp8 GEMM needs codes [N, K/2] (or their tiles) and scales [N, K/{GROUP}] "
                         f"for K = {K}; got {tuple(w.shape)} and {tuple(w_scale.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=a.device)
    if M == 0 or N == 0:
        return out
    a, w, scale = a.contiguous(), w.contiguous().view(torch.uint8), w_scale.contiguous()
    cfg = {**int4_fp8_config(M, N), **(config or {})}
    if cfg.get("CUBLAS") and cublas_supports(a, N, bias, out_dtype) is None:
        return cublas_int4_fp8(a, a_scale, w, scale, zero_point, row_scale)
    words, a_words = w.view(torch.int32), as_words(a)  # eight codes, four codes a word (K is a multiple of 128)
    zero = zero_point.contiguous() if zero_point is not None else scale
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    split = split_k(tiles, K // GROUP, cfg["programs"]) if cfg.get("programs") else 1
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    count = counters(a.device, tiles) if split > 1 else None
    visible(_int4_fp8_kernel)[(tiles, split)](
        a_words, a_scale.reshape(M).contiguous(), words, scale, zero, bias if bias is not None else out, out, ws,
        count if count is not None else ws, M, N, K,
        a_words.stride(0), words.stride(0), scale.stride(0), out.stride(0),
        HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None, OUT=TORCH_TO_TL[out_dtype],
        CAST=cast_mode(_int4_fp8_kernel, a.device), SPLIT_K=split, LAST_SLICE_SUMS=count is not None, GROUP=GROUP,
        DOT=dot_type(_int4_fp8_kernel),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], PAIR_ORDER=cfg.get("PAIR_ORDER", False), TILED=tiled,
        **launch_options(a.device))
    if split > 1 and count is None:
        reduce_partials(ws, out, bias, TORCH_TO_TL[out_dtype])
    return out
