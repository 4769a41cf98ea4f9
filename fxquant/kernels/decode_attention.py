"""Decode attention over a KV cache as it is stored: split-KV flash decoding.

The cache is [B, Hkv, S, D] with any strides, high precision or e4m3 codes with fp32 scales per (batch, KV head,
token) or per tensor. One program takes one (batch, KV head) and one slice of the keys: the query heads that share
the KV head, times the query positions, are the rows of its tile, so the cache is read once per KV head, never per
query head. The slices (splits) make batch 1 fill the GPU; each writes its fp32 partial output and log-sum-exp. The
split that finishes last for its (batch, KV head) merges them, counted in at that pair's counter as split-K GEMMs
count (`splitk.counters`), so a decode layer launches one attention kernel. The merge kernel stays where there are
no counters (a package's tracing, a capture before the first GEMM made them, FXQUANT_SPLIT_REDUCE=kernel); both
run `_merge_pair`, so they give the same bits (docs/decisions/0021-decode-attention-merged-by-the-last-split.md).
Under a boolean mask shared by every query row (transformers' decode mask), each slice first reads the mask to find
the keys it attends to and reads no key block that the mask hides wholly: a static cache allocated past what it
holds reads only what it holds (`attended_span`), though its slices are still planned over the whole length.
Scores, softmax and the merge are fp32; the probabilities are rounded to the cache's dtype for the tensor-core
product with V, as flash attention does, and to fp16 for e4m3 codes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxquant.kernels.cast import cast_float, cast_mode, float_cast_mode, interpreting
from fxquant.kernels.dependent_launch import await_previous, launch_options, start_next, wait_for_previous
from fxquant.kernels.launch import cdiv, next_power_of_2, sm_count, visible
from fxquant.kernels.quant_fp8 import MAX_ROW_LEN, quant_rows, quantize_fp8_rows
from fxquant.kernels.splitk import counters
from fxquant.numerics.formats import AMAX_FLOOR, E4M3

HEAD_DIMS = (64, 128, 256)  # a power of two for the tile's columns; these cover the models served
MAX_ROWS = 64  # query heads per KV head x query positions in one tile
MAX_SPLITS = 64
# (programs per SM, key blocks per split, warps, keys per block): past 4096 keys, and over e4m3 codes, four blocks a
# split. On the H200 it was fastest or within 1% at 8 of 9 points from batch 1 to 64 and 1k to 16k keys at 276a19f,
# before dependent launch (docs/decisions/0010-decode-attention-split-kv.md); the kernel since takes two up to 4k.
DEFAULT_PLAN = (2, 4, 4, 64)  # keys per block: a [64, 128] bf16 tile of K and of V is 16 KB each
# Up to 4096 keys of a high-precision cache, two blocks a split: at B1 5.0 / 6.2 / 8.4 us at 1k / 2k / 4k against
# 7.1 / 7.4 / 9.0 at four blocks, at B16 within 0.3% (docs/decisions/0020-decode-attention-two-blocks-up-to-4k.md).
SHORT_PLAN, SHORT_KEYS = (2, 2, 4, 64), 4096
# e4m3 codes, a block half the bytes of bf16's, by (batch, KV head) pairs. Under 128, blocks of 128 keys, two a
# split; from 128 (B16 at 8 KV heads), three stages. H200 (bench.attention --sweep --codes): B1 16k 16.2 us, 4k 8.2,
# against 22.8 and 11.0 at (2, 4, 4, 64); B16 16k 226.3, 4k 63.8, against 251.9 and 69.7 at (2, 4, 2, 64). From 512
# pairs (B64), 2 warps over 64 keys, as before: 200.5 us at 4k, 199.1 at the B16 plan
# (docs/decisions/0024-decode-attention-plans-over-codes.md). Over codes a plan's first number is the programs an SM
# holds at once (two at 4 warps and about 250 registers a thread; from 512 pairs one split fills a wave of two or of
# the four the 2-warp plan may hold), and the splits fill whole waves of them (`whole_wave_splits`):
# at B16 2 splits in place of 5 took 195.5 against 239.5 us at 16k, at B8 16k 4 in place of 5 123.9 against 166.0,
# on the H100 (docs/decisions/0034-decode-attention-over-codes-in-whole-waves.md).
CODES_PLANS = ((512, (2, 4, 2, 64)), (128, (2, 4, 4, 128, 3)), (0, (2, 2, 4, 128)))  # (from pairs, plan)
# Under 128 pairs up to 4096 keys, one 128-key block a split at most: over caches read from HBM (the plans above were
# timed on one cache, which the L2 held at B1), B1 1k 6.0 us and 4k 8.7 against 8.3 and 10.2; at 16k 22.8 against
# 19.8, so the plan above stays there (docs/decisions/0026-decode-attention-timed-from-hbm.md). In whole waves B1
# keeps its counts (8 splits at 1k, 32 at 4k) and B4 and B8 at 4k take 8 and 4: 21.6 and 36.7 us against 28.4 and
# 43.3 at the 32 and 17 that eight programs an SM asked for (decision 0034).
CODES_SHORT_PLAN = (2, 1, 4, 128)
MASK_SCAN = 1024  # at most this many keys of a boolean mask row read at once to find a slice's span: 1 KB
LOG2_E = tl.constexpr(1.4426950408889634)
PER_TOKEN, GROUPED = tl.constexpr(1), tl.constexpr(2)  # QUANT: a scale per token row, or per group of a head's row
E4M3_MAX = E4M3.max
FLOAT_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _merge_pair(o_part_ptr, lse_part_ptr, sinks_ptr, out_ptr, codes_ptr, qscale_ptr, bh, Q, GROUPS, sob, soh, soq,
                HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr,
                ROWS: tl.constexpr, HAS_SINKS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr,
                QUANT: tl.constexpr, QGROUP: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr,
                AMAX_FLOOR: tl.constexpr):
    """The query rows of pair `bh`: each split's partial output weighted by its share of the softmax's denominator
    (and a sink's), summed in split order in fp32 (an order no tile layout changes, so both callers give the same
    bits), cast once into out. Unrolled over the splits, so every split's loads are in flight at once; read through
    L2 (.cg), since other SMs wrote the partials. QUANT == GROUPED: each head's row is quantized in groups of QGROUP
    instead, from the values out would hold (`_quantize_rows`' layout)."""
    b, h = bh // HKV, bh % HKV
    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUPS * Q
    head, pos = h * GROUPS + rows // Q, rows % Q
    cols = tl.arange(0, D)
    first = bh * SPLITS * BLOCK_M + rows  # row r of split s: first + s * BLOCK_M
    top = tl.full((ROWS,), float("-inf"), tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_part_ptr + first + s * BLOCK_M, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, lse)
    if HAS_SINKS:  # the sink's logit joins the denominator and attends to nothing
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D), tl.float32)
    for s in tl.static_range(SPLITS):
        lse = tl.load(lse_part_ptr + first + s * BLOCK_M, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        weight = tl.exp(lse - top)
        total += weight
        partial = tl.load(o_part_ptr + (first + s * BLOCK_M)[:, None] * D + cols[None, :], mask=row_ok[:, None],
                          other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * partial
    if HAS_SINKS:
        total += tl.exp(sink - top)
    out = cast_float(acc / tl.where(total > 0, total, 1.0)[:, None], OUT, CAST)  # every key masked: 0, never NaN
    if QUANT == GROUPED:  # the rounded output quantized as quantize_fp8 would read it from memory
        codes, scale = quant_rows(tl.reshape(out.to(tl.float32), (ROWS * D // QGROUP, QGROUP)), FMAX, FP8, CAST,
                                  AMAX_FLOOR)
        row = (b * Q + pos) * HKV * GROUPS + head  # the output's [B, Q, Hq] rows of D
        tl.store(codes_ptr + row[:, None].to(tl.int64) * D + cols[None, :], tl.reshape(codes, (ROWS, D)),
                 mask=row_ok[:, None])
        chunk = tl.arange(0, D // QGROUP)
        tl.store(qscale_ptr + row[:, None] * (D // QGROUP) + chunk[None, :], tl.reshape(scale, (ROWS, D // QGROUP)),
                 mask=row_ok[:, None])
    else:
        tl.store(out_ptr + b * sob + head[:, None] * soh + pos[:, None] * soq + cols[None, :], out,
                 mask=row_ok[:, None])


@triton.jit
def _quantize_rows(out_ptr, codes_ptr, qscale_ptr, b, Q, WIDTH, FMAX: tl.constexpr, FP8: tl.constexpr,
                   CAST: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_W: tl.constexpr):
    """Batch row b's Q token rows of the [B, Q, WIDTH] output, each quantized with one scale, as quantize_fp8 reads
    them. Read through L2 (.cg): the pairs merged on other SMs wrote them."""
    cols = tl.arange(0, BLOCK_W)
    col_ok = cols < WIDTH
    for pos in range(Q):
        row = (b * Q + pos).to(tl.int64)
        x = tl.load(out_ptr + row * WIDTH + cols, mask=col_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        codes, scale = quant_rows(x[None, :], FMAX, FP8, CAST, AMAX_FLOOR)
        tl.store(codes_ptr + row * WIDTH + cols[None, :], codes, mask=col_ok[None, :])
        tl.store(qscale_ptr + row + tl.arange(0, 1), scale)


@triton.jit
def attended_span(mask_row_ptr, stride, first, end, BLOCK_N: tl.constexpr, SCAN: tl.constexpr):
    """The keys of [first, end) that a boolean mask row, shared by every query row, lets attend, as (first, end) on
    the key blocks' grid from `first`: the first attended key's block to the last attended key. A block whose every
    key is masked adds exactly nothing (each p is 0; the running max and sum stay as they are), so leaving it unread
    gives the same bits; a slice with none attended gets an empty range, and the -inf it gave before. Additive masks
    are left out: transformers' finfo.min still weighs in a row that has no other key."""
    lo, hi = first, end
    low, high = hi, lo  # the smallest attended key and the largest plus one; (hi, lo) while none is
    for chunk in range(lo, hi, SCAN):
        keys = chunk + tl.arange(0, SCAN)
        ok = keys < hi
        seen = tl.load(mask_row_ptr + keys * stride, mask=ok, other=0)
        attends = ok & (seen != 0)
        low = tl.minimum(low, tl.min(tl.where(attends, keys, hi), 0))
        high = tl.maximum(high, tl.max(tl.where(attends, keys + 1, lo), 0))
    # low < lo only where the slice is empty (a sequence ending before it): its range stays empty, never reaching
    # back into the slice before it
    return lo + tl.maximum(low - lo, 0) // BLOCK_N * BLOCK_N, high


@triton.jit
def _decode_attention_split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, mask_ptr, lens_ptr, o_part_ptr, lse_part_ptr,
    sinks_ptr, out_ptr, counter_ptr, codes_ptr, qscale_ptr,
    # sizes
    S, Q, GROUPS, SPLIT_LEN, scale, softcap, B,
    # strides: q [B, Hq, Q, D], k and v [B, Hkv, S, D], scales [B, Hkv, S], mask [B, Hq, Q, S] (0 where broadcast),
    # out [B, Hq, Q, D]
    sqb, sqh, sqq, skb, skh, sks, svb, svh, svs, ssb, ssh, sss, smb, smh, smq, sms, sob, soh, soq,
    # meta-parameters
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    KV_CODES: tl.constexpr, SCALE_PER_TOKEN: tl.constexpr, MASK: tl.constexpr, MASK_PER_KEY: tl.constexpr,
    HAS_LENS: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    LAST_SPLIT_MERGES: tl.constexpr, ROWS: tl.constexpr, HAS_SINKS: tl.constexpr, OUT: tl.constexpr,
    CAST: tl.constexpr, QUANT: tl.constexpr, QGROUP: tl.constexpr, FMAX: tl.constexpr, FP8: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, BLOCK_W: tl.constexpr, SCAN: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // HKV, bh % HKV
    rows = tl.arange(0, BLOCK_M)  # row r: query head h * GROUPS + r // Q, position r % Q
    row_ok = rows < GROUPS * Q
    head, pos = h * GROUPS + rows // Q, rows % Q
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + head[:, None] * sqh + pos[:, None] * sqq + cols[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    row_scale = scale
    if KV_CODES:  # fp16 products: each row scaled by a power of two to |q| <= 1, exactly, so fp16 cannot overflow
        q_unit = tl.exp2(tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(q), 1), 1e-30))))
        q = q / q_unit[:, None]
        row_scale = (q_unit * scale)[:, None]
    q = q.to(DOT)
    first = split * SPLIT_LEN
    end = tl.minimum(first + SPLIT_LEN, S)
    if HAS_LENS:  # keys past the sequence's length are never read
        end = tl.minimum(end, tl.load(lens_ptr + b))
    if MASK_PER_KEY and MASK == 2:  # nor are blocks of keys the mask hides: a static cache's unfilled tail
        first, end = attended_span(mask_ptr + b * smb, sms, first, end, BLOCK_N, SCAN)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    k_base, v_base = k_ptr + b * skb + h * skh, v_ptr + b * svb + h * svh
    for start in range(first, end, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        k = tl.load(k_base + keys[:, None] * sks + cols[None, :], mask=key_ok[:, None], other=0.0)
        # e4m3 codes are exact in fp16, one conversion per pair on sm_89+: their scales are folded in below
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION)  # fp32 [BLOCK_M, BLOCK_N]
        if KV_CODES and SCALE_PER_TOKEN:
            s *= tl.load(k_scale_ptr + b * ssb + h * ssh + keys * sss, mask=key_ok, other=0.0)[None, :]
        elif KV_CODES:
            s *= tl.load(k_scale_ptr)
        s *= row_scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        if MASK_PER_KEY:  # one row of the mask serves every query row (transformers' [B, 1, 1, S] at one position)
            masked = tl.load(mask_ptr + b * smb + keys * sms, mask=key_ok, other=0)[None, :]
        elif MASK != 0:
            masked = tl.load(mask_ptr + b * smb + head[:, None] * smh + pos[:, None] * smq + keys[None, :] * sms,
                             mask=row_ok[:, None] & key_ok[None, :], other=0)
        if MASK == 1:  # additive
            s += masked.to(tl.float32)
        elif MASK == 2:  # boolean: True attends
            s = tl.where(masked != 0, s, float("-inf"))
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # every key so far masked: nothing to rescale
        # exp(x) as exp2(x * log2(e)): one MUFU instruction on the GPU, as flash attention computes it
        p = tl.exp2((s - m_safe[:, None]) * LOG2_E)
        alpha = tl.exp2((m_i - m_safe) * LOG2_E)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_unit = 1.0
        if KV_CODES and SCALE_PER_TOKEN:  # p * v_scale / the block's largest, in [0, 1]: fp16 is finer there
            v_scale = tl.load(v_scale_ptr + b * ssb + h * ssh + keys * sss, mask=key_ok, other=0.0)
            v_unit = tl.maximum(tl.max(v_scale, 0), 1e-30)
            p *= (v_scale / v_unit)[None, :]
        elif KV_CODES:
            v_unit = tl.load(v_scale_ptr)
        v = tl.load(v_base + keys[:, None] * svs + cols[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION) * v_unit
        m_i = m_new
    # The next kernel launches once every program is past its keys: launched at the start, its waiting programs
    # held SM slots this kernel's own needed (H200, B16 1k: 22.4 against 29.5 us; decision 0021).
    start_next(PDL)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i > 0, m_safe + tl.log(l_i), float("-inf"))  # -inf: this slice attends to nothing
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    part = bh * SPLITS + split
    tl.store(o_part_ptr + (part * BLOCK_M + rows[:, None]) * D + cols[None, :], out, mask=row_ok[:, None])
    tl.store(lse_part_ptr + part * BLOCK_M + rows, lse, mask=row_ok)
    if LAST_SPLIT_MERGES:  # the last split of the pair to count in merges it
        tl.debug_barrier()  # every thread's partial is stored before the count releases it
        done = tl.atomic_add(counter_ptr + bh, 1, sem="acq_rel", scope="gpu")
        if done == SPLITS - 1:
            _merge_pair(o_part_ptr, lse_part_ptr, sinks_ptr, out_ptr, codes_ptr, qscale_ptr, bh, Q, GROUPS, sob, soh,
                        soq, HKV, D, BLOCK_M, SPLITS, ROWS, HAS_SINKS, OUT, CAST, QUANT, QGROUP, FMAX, FP8,
                        AMAX_FLOOR)
            tl.store(counter_ptr + bh, 0)  # the next kernel to count waits for this one to end
            if QUANT == PER_TOKEN:  # the batch row's last pair to merge quantizes its rows (counter B * HKV + b)
                tl.debug_barrier()  # every thread's output is stored before the count releases it
                merged = tl.atomic_add(counter_ptr + B * HKV + b, 1, sem="acq_rel", scope="gpu")
                if merged == HKV - 1:
                    _quantize_rows(out_ptr, codes_ptr, qscale_ptr, b, Q, HKV * GROUPS * D, FMAX, FP8, CAST,
                                   AMAX_FLOOR, BLOCK_W)
                    tl.store(counter_ptr + B * HKV + b, 0)


@triton.jit
def _decode_attention_merge_kernel(
    # pointers
    o_part_ptr, lse_part_ptr, sinks_ptr, out_ptr,
    # sizes and strides: out [B, Hq, Q, D]
    Q, GROUPS, sob, soh, soq,
    # meta-parameters
    HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr, ROWS: tl.constexpr,
    HAS_SINKS: tl.constexpr, OUT: tl.constexpr, CAST: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    _merge_pair(o_part_ptr, lse_part_ptr, sinks_ptr, out_ptr, out_ptr, out_ptr, tl.program_id(0), Q, GROUPS, sob, soh,
                soq, HKV, D, BLOCK_M, SPLITS, ROWS, HAS_SINKS, OUT, CAST, 0, 1, 0.0, tl.float8e4nv, 0.0)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """Why the kernel does not serve these operands, or None where it does: it needs a head dim it tiles, every
    query row of a KV head in one tile, a cache in the query's dtype or in e4m3 codes, rows of contiguous head dims,
    and a 4-D mask over the whole cache."""
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]}; the kernel tiles {', '.join(map(str, HEAD_DIMS))}"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads over {k.shape[1]} KV heads"
    if q.shape[1] // k.shape[1] * q.shape[2] > MAX_ROWS:
        return f"{q.shape[1] // k.shape[1]} query heads x {q.shape[2]} positions per KV head, over {MAX_ROWS} rows"
    if q.dtype not in FLOAT_TL or k.dtype != v.dtype or k.dtype not in (q.dtype, torch.float8_e4m3fn):
        return f"a {q.dtype} query over a {k.dtype}/{v.dtype} cache; the kernel reads the query's dtype or e4m3 codes"
    if mask is not None and (mask.dim() != 4 or mask.shape[-1] != k.shape[2]):
        return f"a mask of shape {tuple(mask.shape)} over {k.shape[2]} cached positions"
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        return "a query or cache whose head dim is not contiguous"
    return None


def num_splits(batch_heads: int, keys: int, device: torch.device, programs_per_sm: int = DEFAULT_PLAN[0],
               blocks_per_split: int = DEFAULT_PLAN[1], block_n: int = DEFAULT_PLAN[3],
               whole_waves: bool = False) -> int:
    """Slices of the keys: about `programs_per_sm` programs per SM over the (batch, KV head) pairs, at least
    `blocks_per_split` key blocks a slice; whole_waves: `whole_wave_splits` with programs_per_sm the programs an SM
    holds. A function of the shapes only, so a CUDA graph replays the same grid."""
    most = max(1, min(cdiv(cdiv(keys, block_n), blocks_per_split), MAX_SPLITS))
    if whole_waves:
        return whole_wave_splits(batch_heads, programs_per_sm * sm_count(device), most)
    return min(cdiv(programs_per_sm * sm_count(device), batch_heads), most)


def whole_wave_splits(batch_heads: int, slots: int, most: int) -> int:
    """The fewest splits, up to `most`, whose programs fill their waves of `slots` programs at once to 95%, else the
    count that fills them best. Rounding the programs wanted up to whole splits can start a wave that runs nearly
    empty (B16 at 8 KV heads, two programs an SM on 132 SMs: 5 splits, 640 programs, the third wave 42% full); of
    the counts that fill their waves, the fewest read the longest runs of keys and leave the fewest partials."""
    fill = lambda s: batch_heads * s / (cdiv(batch_heads * s, slots) * slots)
    counts = range(1, most + 1)
    return next((s for s in counts if fill(s) >= 0.95), max(counts, key=fill))


def launch_plan(batch_heads: int, keys: int, codes: bool, device: torch.device, plan=None) -> tuple[tuple, int]:
    """The launch plan (programs per SM, key blocks per split, warps, keys per block[, stages]) for (batch, KV head)
    pairs over `keys` of a high-precision cache or of e4m3 codes, and its split count; `plan` in place of the
    default, split as plans were swept (without whole waves)."""
    if codes:
        default = next(plan for pairs, plan in CODES_PLANS if batch_heads >= pairs)
        if batch_heads < 128 and keys <= SHORT_KEYS:
            default = CODES_SHORT_PLAN
    else:
        default = SHORT_PLAN if keys <= SHORT_KEYS else DEFAULT_PLAN
    programs_per_sm, blocks_per_split, _, block_n, *_ = plan or default
    return plan or default, num_splits(batch_heads, keys, device, programs_per_sm, blocks_per_split, block_n,
                                       whole_waves=codes and plan is None)


def output_like(q: torch.Tensor) -> torch.Tensor:
    """The output of attention for q [B, Hq, Q, D]: stored [B, Q, Hq, D], as the o-projection reads it
    (o.transpose(1, 2).reshape(B, Q, Hq * D) is a view) and as the fused quantizer's last pair reads a token's row.
    One layout whatever q's, so the op's fake gives the same strides: empty_like(q) kept q's, which a fake tensor
    and a real one lay out differently along a dim of size 1."""
    batch, heads_q, queries, dim = q.shape
    return torch.empty((batch, queries, heads_q, dim), device=q.device, dtype=q.dtype).transpose(1, 2)


def fuses_quantization(q: torch.Tensor, group_size: int) -> bool:
    """Whether the kernel quantizes its own output in groups of `group_size` (0: a scale per token's row of all
    heads), where the pairs have counters: a group within a head's row, or a token's row that fits a program's
    registers (quant_fp8.MAX_ROW_LEN)."""
    width = q.shape[1] * q.shape[3]
    return (group_size == 0 and width <= MAX_ROW_LEN) or (group_size > 0 and q.shape[3] % group_size == 0)


def decode_attention_quantized(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens, group_size: int):
    """decode_attention's output o as the o-projection reads it, o.transpose(1, 2).reshape(B, Q, Hq * D), quantized
    as quantize_fp8(.., group_size) quantizes it: (e4m3 codes [B, Q, Hq * D], fp32 scales [B, Q, groups]), with the
    same bits. Where the pairs have counters and `fuses_quantization`, the kernel quantizes as it merges: a
    group within a head's row at once, a token's row by the batch row's last pair to merge. Elsewhere the output is
    stored, then quantized by quant_fp8's kernel."""
    batch, heads_q, queries, dim = q.shape
    width = heads_q * dim
    if not fuses_quantization(q, group_size) or counters(q.device, batch * k.shape[1] + batch) is None:
        out = decode_attention(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens)
        return quantize_fp8_rows(out.transpose(1, 2).reshape(batch, queries, width), group_size or width)
    codes = torch.empty((batch, queries, width), device=q.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty((batch, queries, width // group_size if group_size else 1), device=q.device,
                         dtype=torch.float32)
    decode_attention(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens, quantized=(codes, scales))
    return codes, scales


def decode_attention(q, k, v, mask, scale, softcap, sinks, k_scale, v_scale, kv_lens, *, plan=None, splits=None,
                     quantized=None) -> torch.Tensor | None:
    """q [B, Hq, Q, D] over the cache k, v [B, Hkv, S, D]: reference_attention.decode_attention's result. plan:
    (programs per SM, key blocks per split, warps, keys per block[, pipeline stages]) in place of the defaults, and
    splits in place of `num_splits`' count, for bench.attention's sweeps. quantized: (codes, scales) that
    `decode_attention_quantized` made, which the kernel fills instead of returning the output."""
    batch, heads_q, queries, dim = q.shape
    heads_kv, keys = k.shape[1], k.shape[2]
    groups = heads_q // heads_kv
    block_m = max(16, next_power_of_2(groups * queries))
    codes = k.dtype == torch.float8_e4m3fn
    plan, picked = launch_plan(batch * heads_kv, keys, codes, q.device, plan)
    programs_per_sm, blocks_per_split, warps, block_n, *stages = plan
    splits = splits or picked
    split_len = cdiv(cdiv(keys, splits), block_n) * block_n
    splits = cdiv(keys, split_len)
    o_part = torch.empty((batch * heads_kv * splits, block_m, dim), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((batch * heads_kv * splits, block_m), device=q.device, dtype=torch.float32)
    per_token = codes and k_scale.numel() > 1
    scales = k_scale.expand(batch, heads_kv, keys) if per_token else None
    if mask is not None:
        mask = mask.expand(batch, heads_q, queries, keys) if mask.dim() == 4 else mask
    per_key = mask is not None and mask.stride(1) == 0 and (queries == 1 or mask.stride(2) == 0)
    # Under Triton's interpreter, whose bf16 dot is wrong, the products run in fp32 on the same operands. e4m3 codes
    # multiply in fp16, which holds them exactly (bf16 would too, at two conversions per code on sm_90).
    dot = tl.float32 if interpreting(_decode_attention_split_kernel) else tl.float16 if codes else FLOAT_TL[q.dtype]
    cast = float_cast_mode(_decode_attention_merge_kernel)
    out = output_like(q)
    count = counters(q.device, batch * heads_kv)
    # the merge kernel takes the split's warps: one tile layout for both callers of _merge_pair
    merge = dict(ROWS=next_power_of_2(groups * queries), HAS_SINKS=sinks is not None, OUT=FLOAT_TL[q.dtype],
                 CAST=cast, num_warps=warps, **launch_options(q.device))
    quantize = dict(QUANT=0, QGROUP=1, FMAX=0.0, FP8=tl.float8e4nv, AMAX_FLOOR=0.0, BLOCK_W=1)
    codes_out = scales_out = q
    if quantized is not None:
        codes_out, scales_out = quantized
        group = heads_q * dim // scales_out.shape[-1]
        count = counters(q.device, batch * heads_kv + batch)  # the pairs', then each batch row's
        quantize = dict(QUANT=PER_TOKEN if scales_out.shape[-1] == 1 else GROUPED, QGROUP=group, FMAX=E4M3_MAX,
                        FP8=tl.float8e4nv, AMAX_FLOOR=AMAX_FLOOR, BLOCK_W=next_power_of_2(heads_q * dim))
        merge["CAST"] = cast_mode(_decode_attention_split_kernel, q.device)  # casts to e4m3 too
    visible(_decode_attention_split_kernel)[(batch * heads_kv, splits)](
        q, k, v, k_scale if codes else q, v_scale if codes else q, mask if mask is not None else q,
        kv_lens if kv_lens is not None else q, o_part, lse_part,
        sinks if sinks is not None else q, out, count if count is not None else lse_part, codes_out, scales_out,
        keys, queries, groups, split_len, scale, softcap, batch,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        *(scales.stride() if per_token else (0, 0, 0)),
        *(mask.stride() if mask is not None else (0, 0, 0, 0)),
        out.stride(0), out.stride(1), out.stride(2),
        HKV=heads_kv, D=dim, BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits, KV_CODES=codes,
        SCALE_PER_TOKEN=per_token, MASK=0 if mask is None else 2 if mask.dtype == torch.bool else 1,
        MASK_PER_KEY=per_key,
        HAS_LENS=kv_lens is not None, SOFTCAP=softcap > 0, DOT=dot,
        PRECISION="ieee" if dot == tl.float32 else "tf32", LAST_SPLIT_MERGES=count is not None,
        SCAN=min(MASK_SCAN, next_power_of_2(split_len)),  # a slice's keys in one load, no wider
        num_stages=stages[0] if stages else 2, **merge, **quantize,
    )
    if quantized is not None:
        return None
    if count is None:
        visible(_decode_attention_merge_kernel)[(batch * heads_kv,)](
            o_part, lse_part, sinks if sinks is not None else q, out, queries, groups,
            out.stride(0), out.stride(1), out.stride(2),
            HKV=heads_kv, D=dim, BLOCK_M=block_m, SPLITS=splits, **merge,
        )
    return out
