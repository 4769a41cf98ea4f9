"""Weight-only GEMMs: out[M, N] = A[M, K] (bf16/fp16) @ dequantize(W)[N, K].T (+ bias), fp32 accumulation.

Two paths, chosen by M from a measured crossover. Up to DEQUANTIZE_ABOVE_M the weight is dequantized in registers,
tile by tile, with no full-precision copy of it. Past it the weight is dequantized to the activation dtype
(`dequantize_weight.py`, at most CHUNK_ELEMENTS at a time) and cuBLAS multiplies it.

In registers, each code is turned into a value the activation dtype holds exactly, so the tensor cores multiply
exact operands:
- int8 per channel: the integer code; the channel scale is applied once in the epilogue;
- int4, groups of 128 along K, with zero point: the integer q - z, built from bits (no int -> float
  conversions); the group's fp32 scale multiplies the step's fp32 partial sum;
- MXFP4: the e2m1 value times its block's power-of-two E8M0 scale (exact: 2 significant bits);
- NVFP4: the e2m1 value times its block's e4m3 scale (exact: at most 6 significant bits); the fp32 global
  scale is applied in the epilogue. In bf16 one packed multiply per pair applies the scale and the decode's 2^126
  at once, leaving each value times 2^-8 (exact), which the epilogue's global scale restores (381 -> 359
  instructions a K step on sm_90, `python -m bench.sass nvfp4`);
- MXFP8: the e4m3 value times its block's E8M0 scale, in bf16 only (exact: 4 significant bits, and bf16 has
  fp32's exponent range down to 2^-133; fp16 could clip it).
Packed 4-bit weights hold K-pairs per byte (low nibble first); the kernel reads them as int32 words of 8 codes
(4-bit K must be a multiple of 8) and decodes each word in the thread that loaded it, two codes per instruction
in bf16, and in fp16 for int4 (`codes.py`).
Where the output tiles are too few for the SMs, K is split across programs (`splitk.py`). K and N tails are masked.
Under Triton's interpreter, whose bf16 dot is wrong, the dot runs in fp32 on the same exact operands.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fxquant.kernels.cast import float_cast_mode, interpreting
from fxquant.kernels.code_tiles import TILE_ROWS, is_tiled, tiled_shape
from fxquant.kernels.codes import (
    FORMATS,
    NVFP4_UNSCALE,
    PACKED,
    dot_operands,
    fp4_values,
    int4_integers,
    mxfp8_values,
    packed_word_offsets,
    packed_words,
    scale_codes,
    scale_value,
)
from fxquant.kernels.dependent_launch import launch_options, prefetch_l2, prefetching, steps_ahead, wait_for_previous
from fxquant.kernels.dequantize_weight import dequantize_weight
from fxquant.kernels.gemm_fp8 import TORCH_TO_TL
from fxquant.kernels.launch import cdiv, visible
from fxquant.kernels.splitk import TARGET_PROGRAMS, counters, reduce_partials, split_k, sum_if_last_slice
from fxquant.kernels.tiles import k_steps_of, store_tile, tile_offsets


@triton.jit
def wo_accumulate(a_ptr, w_ptr, s_ptr, z_ptr, offs_m, offs_n, M, N, K, first_k, last_k,
                  stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk,
                  FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, DOT: tl.constexpr,
                  EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PAIR_ORDER: tl.constexpr, TILED: tl.constexpr = False):
    """The fp32 tile A[offs_m] @ W[offs_n].T over K steps [first_k, last_k), each code decoded in registers to a
    value DOT holds exactly; int8's channel scale and NVFP4's global scale are left to `wo_scale_tile`.
    PAIR_ORDER: packed 4-bit codes and the activations meet in `codes.pair_order`, not in K order. TILED: packed
    4-bit codes in `code_tiles`' tiles."""
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first_k, last_k):
        k = step * BLOCK_K + offs_k
        a_mask = mask_m[:, None] if EVEN_K else mask_m[:, None] & (k[None, :] < K)  # row masks keep vector loads
        a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + k[None, :] * stride_ak, mask=a_mask,
                    other=0.0).to(DOT)  # [BM, BK]
        if FMT == 0:
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None] * stride_wk,
                        mask=mask_n[None, :] & (k[:, None] < K), other=0)  # [BK, BN]: the MMA's B operand as loaded
            # through fp32: the interpreter mangles int8 -> bf16, and fp32 -> bf16 of a small integer is exact
            acc = tl.dot(a, w.to(tl.float32).to(DOT), acc)
        elif FMT == 1:
            packed = packed_words(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K, EVEN_K, TILED)
            s_index = step * BLOCK_K // GROUP  # BLOCK_K divides GROUP: one group per K step
            scale = tl.load(s_ptr + offs_n * stride_sn + s_index * stride_sk, mask=mask_n, other=0.0)
            # The MMA multiplies exact small integers, q - z, and the group's fp32 scale multiplies the fp32
            # partial sum: more exact than a dequantized weight rounded to bf16, and no int -> float conversions.
            ints = int4_integers(packed, z_ptr, offs_n, mask_n, s_index, stride_sn, stride_sk, HAS_ZP, DOT)
            x, w = dot_operands(a, ints, PAIR_ORDER)
            acc += tl.dot(x, w) * scale[None, :]
        else:
            BLOCKS: tl.constexpr = BLOCK_K // GROUP  # scale blocks per K step (BLOCK_K is a multiple of 16, 32)
            offs_b = step * BLOCKS + tl.arange(0, BLOCKS)
            raw = scale_codes(s_ptr, offs_n[:, None], offs_b[None, :], stride_sn, stride_sk,
                              mask_n[:, None] & (offs_b[None, :] * GROUP < K))  # [BN, BLOCKS]
            if FMT == 4:
                codes = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + k[None, :] * stride_wk,
                                mask=mask_n[:, None] & (k[None, :] < K), other=0)  # [BN, BK]
                acc = tl.dot(a, tl.trans(mxfp8_values(codes, scale_value(raw, FMT), GROUP).to(DOT)), acc)
            else:
                packed = packed_words(w_ptr, offs_n, mask_n, step, K, stride_wn, BLOCK_K, EVEN_K, TILED)
                x, w = dot_operands(a, fp4_values(packed, raw, GROUP, DOT, FMT), PAIR_ORDER)
                acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def wo_scale_tile(acc, s_ptr, gs_ptr, offs_n, N, stride_sn, FMT: tl.constexpr, DOT: tl.constexpr):
    """The scales constant along K, applied once to the tile: int8's per channel, NVFP4's global (in bf16, with the
    2^8 its prescaled values were short of: `codes.fp4_values`; a power of two, so the product is the same)."""
    if FMT == 0:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=offs_n < N, other=0.0)[None, :]
    if FMT == 3:
        acc = acc * (tl.load(gs_ptr) * NVFP4_UNSCALE if DOT == tl.bfloat16 else tl.load(gs_ptr))
    return acc


@triton.jit
def _wo_gemm_kernel(
    # pointers
    a_ptr, w_ptr, s_ptr, z_ptr, gs_ptr, c_ptr, ws_ptr, bias_ptr, counter_ptr,
    # sizes
    M, N, K,
    # strides (the weight's in its own elements: bytes for int8, int32 words of packed codes for 4-bit)
    stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk, stride_cm, stride_cn,
    # meta-parameters
    FMT: tl.constexpr, GROUP: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    LAST_SLICE_SUMS: tl.constexpr, DOT: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PDL: tl.constexpr,
    PAIR_ORDER: tl.constexpr, TILED: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    if not PREFETCH:
        wait_for_previous(PDL)
    pid_k = tl.program_id(1)
    pid_m, pid_n, offs_m, offs_n = tile_offsets(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    first_k, last_k = k_steps_of(pid_k, K, BLOCK_K, SPLIT_K)
    if PREFETCH:  # packed 4-bit codes, which no kernel writes: the L2 fetches their first steps meanwhile
        words = steps_ahead(first_k, last_k) * (BLOCK_K // 8)  # the first word of each step a row
        rows = tl.minimum(offs_n, N - 1)  # a tile past N asks for the last row again
        prefetch_l2(w_ptr + packed_word_offsets(rows[:, None], words[None, :], K, stride_wn, TILED))
        wait_for_previous(PDL)
    acc = wo_accumulate(a_ptr, w_ptr, s_ptr, z_ptr, offs_m, offs_n, M, N, K, first_k, last_k,
                        stride_am, stride_ak, stride_wn, stride_wk, stride_sn, stride_sk,
                        FMT, GROUP, HAS_ZP, DOT, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PAIR_ORDER, TILED)
    acc = wo_scale_tile(acc, s_ptr, gs_ptr, offs_n, N, stride_sn, FMT, DOT)
    store_tile(acc, c_ptr, ws_ptr, bias_ptr, offs_m, offs_n, M, N, stride_cm, stride_cn, pid_k,
               HAS_BIAS, SPLIT_K, OUT, CAST)
    if LAST_SLICE_SUMS:
        sum_if_last_slice(ws_ptr, c_ptr, bias_ptr, counter_ptr, tl.program_id(0), offs_m, offs_n, M, N,
                          stride_cm, stride_cn, HAS_BIAS, SPLIT_K, OUT, CAST)


def wo_gemm_config(M: int, K: int, fmt: str) -> dict:
    """Tiles for the in-register path (M <= DEQUANTIZE_ABOVE_M) by M bucket and format: the winners of
    `bench/weight_only.py --sweep` (decode) and `--sweep --medium` on an H200 for the Llama shapes
    (docs/decisions/0005-weight-only-tiles.md).
    `programs` is the split-K target (None: no split). Decode streams the weight with narrow N tiles, aiming at
    1056 programs (8 per SM) for 4-bit formats, whose unpacking needs more warps in flight to hide load latency; a
    long K (down_proj's 14336) does better at 528 (int4 at M = 1: 21.1 us against 23.0), where slices of 14 K steps
    instead of 7 amortize each program's pipeline fill. Medium M splits K toward 264 programs: on 4096x14336 an
    int4 product at M = 32 took 27.8 us against 80.2 us dequantized. BLOCK_K divides int4's group of 128 and is a
    multiple of every block (16, 32). MXFP8, whose codes are decoded through fp32, takes the 4-bit formats' decode
    tiles and FP4's medium ones: at M = 1 they took 12.7 / 27.1 / 26.5 us on 4096x4096 / 14336x4096 / 4096x14336
    against 12.2 / 30.5 / 32.6 on int8's tile, and at M = 64 46.1 against 50.9 on 14336x4096.
    PAIR_ORDER (off): the operands meet in `codes.pair_order`, where each decoded pair is the register the MMA reads.
    Compiled for sm_90 it cut a 16-row K step from 263 to 227 instructions (int4), 391 to 355 (MXFP4), 359 to 319
    (NVFP4), but on the H200 it ran slower on 26 of 27 Llama shapes and M (1, 16, 32): int4 at M = 1 24.2 against 19.7
    us on 4096x14336, NVFP4 36.6 against 27.6 (`python -m bench.weight_only --pair-order` at 12e4074,
    weight_only_pairs_12e4074.txt)."""
    decoded = fmt != "int8"  # codes that take more instructions than int8's one conversion to become values
    narrow = fmt in ("mxfp4", "nvfp4", "mxfp8")
    if M <= 16:
        programs = (528 if K > 8192 else 1056) if decoded else TARGET_PROGRAMS
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3 if decoded else 5,
                    programs=programs)
    medium = dict(BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, programs=TARGET_PROGRAMS)
    if M <= 32:
        return {**medium, "BLOCK_M": 32, "BLOCK_N": 64}
    if M > 64 and fmt != "int4":
        # 128-row tiles on 8 warps, split toward 132: at M = 128 int8 took 45.6 us against 54.7 on 64x128 tiles
        # (14336x4096) and MXFP4 67.2 against 72.3 (4096x14336); int4 ran slower on them (85.7 against 68.1).
        return {**medium, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "programs": TARGET_PROGRAMS // 2}
    # FP4 at M = 64 ran faster on 64-wide tiles: 40.8 us against 48.8 on 14336x4096 (MXFP4).
    return {**medium, "BLOCK_M": 64, "BLOCK_N": 64 if narrow else 128}


# Past this M, dequantizing the weight once per call and running cuBLAS beats dequantizing in registers: at M = 256
# int4 took 138 us in registers against 93 us dequantized on 14336x4096. Up to it the in-register kernel with split-K
# won on every Llama shape (docs/decisions/0006-weight-only-dequantize-past-m128.md). A GEMM dequantizing its weight
# tile by tile on wgmma ran 0.51-0.65x bf16 at M >= 1024, where this route runs 0.80-0.96x
# (docs/decisions/0025-weight-only-prefill-stays-dequantized.md).
DEQUANTIZE_ABOVE_M = 128
# The dequantized weight exists at most this many elements at a time (256 MiB in bf16). At 2**26 a merged 28672x4096
# gate/up took two chunks, each with a strided copy of its output columns: 7% of an int4_wo prefill
# (docs/decisions/0006-weight-only-dequantize-past-m128.md). 2**27 holds it in one, and chunks without a bias write
# their columns in place.
CHUNK_ELEMENTS = 2**27


@functools.lru_cache(maxsize=1024)
def _launch_plan(M: int, N: int, K: int, fmt: str, group: int, overrides: tuple | None):
    """(output tiles, K slices, tile meta-parameters) of the in-register kernel, or None where the product
    dequantizes the weight instead: the same for every call at a shape, so worked out once. overrides: an
    explicit tile config as (name, value) pairs, which always takes the in-register kernel."""
    cfg = dict(overrides) if overrides is not None else wo_gemm_config(M, K, fmt)
    in_registers = not (fmt == "int4" and group % cfg["BLOCK_K"])  # one int4 group per K step, at least
    if overrides is None and (not in_registers or M > DEQUANTIZE_ABOVE_M):
        return None
    if not in_registers:
        raise ValueError(f"fxquant: int4 groups of {group} need BLOCK_K dividing them, got {cfg['BLOCK_K']}")
    tiles = cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"])
    split = split_k(tiles, cdiv(K, cfg["BLOCK_K"]), cfg["programs"]) if cfg.get("programs") else 1
    meta = dict(EVEN_K=K % cfg["BLOCK_K"] == 0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"], PAIR_ORDER=cfg.get("PAIR_ORDER", False) and fmt in PACKED)
    return tiles, split, meta


def supports(a: torch.Tensor, fmt: str) -> str | None:
    """Why the weight-only kernels (this one and the grouped ones) cannot multiply activations `a` by a `fmt`
    weight, or None where they can."""
    if not a.is_cuda:
        return "they run on CUDA devices (the CPU takes the reference)"
    return dtype_refusal(a.dtype, fmt)


def dtype_refusal(dtype: torch.dtype, fmt: str) -> str | None:
    """What in the activations' dtype alone keeps these kernels from a `fmt` weight on a GPU, or None."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"they multiply bf16 or fp16 activations, not {dtype}"
    if fmt == "mxfp8" and dtype != torch.bfloat16:
        return "an mxfp8 weight multiplies bf16 activations, the 16-bit type with MXFP8's range"
    return None


def weight_operands(a, w, w_scale, fmt: str, group: int, N: int):
    """(codes, scales) as the kernels read them, for a weight [..., N, K] (one leading dim per expert): packed 4-bit
    rows as int32 words of 8 codes, e4m3 codes as bytes, FP4/MX block scales as their raw bytes, scales [..., N, -1].
    Raises, naming the fix, where the activations or the weight do not fit the format."""
    K = a.shape[-1]
    lead = tuple(w.shape[:-2])
    if fmt not in FORMATS or a.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fxquant: weight-only GEMM takes bf16/fp16 activations and one of {list(FORMATS)}; got "
                         f"{a.dtype} and {fmt!r}")
    if fmt == "mxfp8" and a.dtype != torch.bfloat16:  # fp16 would clip MXFP8 values outside its range
        raise ValueError("fxquant: an mxfp8 weight multiplies bf16 activations, the 16-bit type with MXFP8's "
                         f"range; got {a.dtype}: cast the activations to bf16")
    packed = fmt in PACKED
    if fmt in PACKED and is_tiled(w):
        if w.shape != tiled_shape(N, K):
            raise ValueError(f"fxquant: {fmt} code tiles must be {tiled_shape(N, K)} for an [N={N}, K={K}] weight, "
                             f"got {tuple(w.shape)}")
        lead = ()
    elif w.shape[-2:] != (N, K // 2 if packed else K) or (packed and K % 8):
        raise ValueError(f"fxquant: {fmt} weight codes must be [..., N={N}, K{'/2' if packed else ''}] for a "
                         f"[M, K={K}]{' with K a multiple of 8' if packed else ''}, got {tuple(w.shape)}")
    if group and group & (group - 1):
        raise ValueError(f"fxquant: weight-only groups must be powers of two, got {group}")
    scale = w_scale.view(torch.uint8) if fmt in ("mxfp4", "nvfp4", "mxfp8") else w_scale
    # packed 4-bit rows as words of 8 codes; e4m3 codes as bytes
    # (packed words through 1-D: a size-1 leading dim may carry any stride, which view() to int32 refuses)
    words = lambda t: t.contiguous().reshape(-1).view(torch.int32).reshape(*t.shape[:-1], -1)
    codes = words(w) if packed else w.view(torch.uint8) if fmt == "mxfp8" else w
    return codes, scale.reshape(*lead, N, -1)


def weight_only_mm(a, w, w_scale, fmt: str, group: int, N: int, *, zero_point=None, global_scale=None,
                   bias=None, config=None):
    """a: [M, K] bf16/fp16 (bf16 for mxfp8); w: the codes as `fxquant.quantize` packs them ([N, K] int8 or e4m3,
    or [N, K/2] uint8), or packed 4-bit codes in `code_tiles`' tiles; w_scale: [N, 1] (int8), [N, K/group] fp32 (int4),
    E8M0 (mxfp4, mxfp8) or e4m3 (nvfp4). Returns [M, N] in a's dtype.
    Up to DEQUANTIZE_ABOVE_M, or at any M given an explicit tile `config`, the weight is dequantized in registers;
    past it, and for int4 groups narrower than a K step, it is dequantized to the activation dtype in chunks of at
    most CHUNK_ELEMENTS, each multiplied by cuBLAS."""
    M, K = a.shape
    codes, scale = weight_operands(a, w, w_scale, fmt, group, N)
    if M == 0 or N == 0:
        return torch.empty((M, N), dtype=a.dtype, device=a.device)
    overrides = tuple(sorted(config.items())) if config is not None else None
    plan = _launch_plan(M, N, K, fmt, group, overrides)
    if plan is None:
        return _dequantized_mm(a, codes, scale, fmt, group, N, zero_point, global_scale, bias)
    tiles, split, meta = plan
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    ws = torch.empty((split, M, N), dtype=torch.float32, device=a.device) if split > 1 else out
    count = counters(a.device, tiles) if split > 1 else None
    pdl = launch_options(a.device)
    visible(_wo_gemm_kernel)[(tiles, split)](
        a, codes, scale, zero_point if zero_point is not None else scale,
        global_scale if global_scale is not None else scale, out, ws, bias if bias is not None else out,
        count if count is not None else ws,
        M, N, K,
        a.stride(0), a.stride(1), codes.stride(0), codes.stride(1), scale.stride(0), scale.stride(1),
        out.stride(0), out.stride(1),
        FMT=FORMATS[fmt], GROUP=group or 1, HAS_ZP=zero_point is not None, HAS_BIAS=bias is not None,
        SPLIT_K=split, LAST_SLICE_SUMS=count is not None,
        DOT=tl.float32 if interpreting(_wo_gemm_kernel) else TORCH_TO_TL[a.dtype],
        OUT=TORCH_TO_TL[a.dtype], CAST=float_cast_mode(_wo_gemm_kernel), TILED=is_tiled(codes), **meta,
        PREFETCH=fmt in PACKED and prefetching(pdl), **pdl,
    )
    if split > 1 and count is None:
        reduce_partials(ws, out, bias, TORCH_TO_TL[a.dtype])
    return out


def _dequantized_mm(a, codes, scale, fmt, group, N, zero_point, global_scale, bias):
    """a @ W.T (+ bias) with W dequantized to a's dtype by row chunks, each chunk's product run by cuBLAS; tiled
    codes by whole tiles of rows."""
    K = a.shape[1]
    unit = TILE_ROWS if is_tiled(codes) else 1  # rows a slice of the codes holds
    rows = max(1, CHUNK_ELEMENTS // K // unit) * unit
    chunk = lambda t, n0, n1: None if t is None else t[n0:n1]
    codes_of = lambda n0, n1: codes[n0 // unit: n1 // unit]
    weight = lambda n0, n1: dequantize_weight(codes_of(n0, n1), scale[n0:n1], fmt, group, K, a.dtype,
                                              zero_point=chunk(zero_point, n0, n1), global_scale=global_scale)
    if rows >= N:
        return F.linear(a, weight(0, N), bias)
    out = torch.empty((a.shape[0], N), dtype=a.dtype, device=a.device)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        if bias is None:  # the GEMM writes its column block in place (leading dimension N): no copy of it
            torch.mm(a, weight(n0, n1).T, out=out[:, n0:n1])
        else:
            out[:, n0:n1] = F.linear(a, weight(n0, n1), bias[n0:n1])
    return out
