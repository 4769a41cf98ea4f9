"""Decode attention alone, Llama-3-8B heads (32 query heads, 8 KV heads, head dim 128), one query position, over a
static KV cache of B sequences x context tokens: fxquant's split-KV kernel on the bf16 cache (with and without
transformers' additive mask, with the mask merged by the separate merge kernel rather than the last split, and with
its output quantized per token for an fp8 o-projection, in the kernel or by the row quantizer after it) and on
an e4m3 cache with per-(token, KV head) or per-tensor scales, against torch's
SDPA after repeat_kv (the cache copied per query head, as transformers' eager path and Inductor run it), SDPA with
enable_gqa=True (no mask) and FlexAttention's decoding (compiled; at 4k only, its compile per shape is long).

Each figure is microseconds per call from CUDA-graph replay, cycling through as many independent caches as defeat the
L2 (every call reads its cache from HBM, as a decode step does; one cache timed alone stayed in the L2 at B1 up to 4k
keys: docs/decisions/0026-decode-attention-timed-from-hbm.md), and the percentage of the measured copy bandwidth that
reading the cache once (K and V, codes and scales for fp8) at that time would be. The outputs are checked against
reference_attention's fp32 result first.

With --filled N the cache of each context holds N tokens and the decode mask hides the rest, as a static cache
allocated past what it holds (`filled_paths`); the percentages are then of the filled keys' bytes.

Run: python -m bench.attention [--batches 1 16 64] [--contexts 1024 4096 16384] [--sweep [--codes]] [--filled N]
     python -m bench.attention --splits 1 2 4 5 [--bf16] [--batches ..] [--contexts ..]   (the e4m3 cache's kernel,
         or with --bf16 the bf16 cache's, at these split counts, beside the count it picks)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from bench.common import copy_bandwidth_gbs, graph_time_ms, header, rotating, table
from fxquant.kernels.splitk import reduce_in_gemm
from fxquant.numerics import reference_attention as RA

HEADS_Q, HEADS_KV, DIM = 32, 8, 128
REPEAT_LIMIT = 24 * 2**30  # the repeated cache's bytes above which the SDPA-after-repeat row is not run


def fp8_cache(t: torch.Tensor, per_token: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 scales per (batch, KV head, token), or one per tensor: amax / 448, floored as fxquant's
    scales are."""
    if per_token:
        scale = t.float().abs().amax(-1).clamp_min(2**-9) / 448
        return (t.float() / scale[..., None]).to(torch.float8_e4m3fn), scale
    scale = t.float().abs().amax().reshape(1).clamp_min(2**-9) / 448
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def with_merge_kernel(fn):
    """fn with its split-KV partials merged by the separate merge kernel (as where no counters are kept)."""
    def run(*args):
        with reduce_in_gemm(False):
            return fn(*args)
    return run


def cache_set(batch: int, context: int, gen: torch.Generator) -> dict:
    """One independent query, bf16 cache, its e4m3 codes (scales per token and per tensor) and mask."""
    q = torch.randn(batch, HEADS_Q, 1, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(batch, HEADS_KV, context, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    mask = torch.zeros(batch, 1, 1, context, device="cuda", dtype=torch.bfloat16)
    mask[0, ..., : context // 8] = torch.finfo(torch.bfloat16).min  # the first sequence left-padded
    (kc, ks), (vc, vs) = fp8_cache(k), fp8_cache(v)
    (kt, kts), (vt, vts) = fp8_cache(k, per_token=False), fp8_cache(v, per_token=False)
    return dict(q=q, k=k, v=v, mask=mask, kc=kc, ks=ks, vc=vc, vs=vs, kt=kt, kts=kts, vt=vt, vts=vts)


def cache_sets(batch: int, context: int) -> list[tuple[dict]]:
    """As many independent sets as defeat the L2 (bench.common.rotating), each call's cache read from HBM as a decode
    step reads it: a 4 MB cache (B1, 1k keys) timed alone would stay in the H200's L2 and time its latency only."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    codes_bytes = 2 * batch * HEADS_KV * context * DIM  # the fewest bytes a row reads: e4m3 K and V
    return rotating(lambda: (cache_set(batch, context, gen),), codes_bytes)


def paths(batch: int, context: int):
    """(name, function of one cache set, bytes it must read) for one shape, the cache sets, and the fp32 references
    of the first set."""
    sets = cache_sets(batch, context)
    scale = DIM**-0.5
    first = sets[0][0]
    cache_bytes = 2 * first["k"].numel() * first["k"].element_size()
    codes_bytes, tensor_bytes = 2 * (first["kc"].numel() + 4 * first["ks"].numel()), 2 * first["kt"].numel()
    attn = torch.ops.fxquant.decode_attention
    masked = lambda c: attn(c["q"], c["k"], c["v"], c["mask"], scale, 0.0, None, None, None, None)
    rows = [
        ("fxquant bf16 cache", lambda c: attn(c["q"], c["k"], c["v"], None, scale, 0.0, None, None, None, None),
         cache_bytes),
        ("fxquant bf16 cache, mask", masked, cache_bytes),
        ("fxquant bf16 cache, mask, merge kernel", with_merge_kernel(masked), cache_bytes),
        ("fxquant bf16 cache, mask, output quantized", lambda c: torch.ops.fxquant.decode_attention_quantize_fp8(
            c["q"], c["k"], c["v"], c["mask"], scale, 0.0, None, None, None, None, 0), cache_bytes),
        ("fxquant bf16 cache, mask, then the row quantizer", lambda c: torch.ops.fxquant.quantize_fp8(
            masked(c).transpose(1, 2).reshape(batch, 1, HEADS_Q * DIM), 0), cache_bytes),
        ("fxquant fp8 cache, mask",
         lambda c: attn(c["q"], c["kc"], c["vc"], c["mask"], scale, 0.0, None, c["ks"], c["vs"], None), codes_bytes),
        ("fxquant fp8 per-tensor, mask",
         lambda c: attn(c["q"], c["kt"], c["vt"], c["mask"], scale, 0.0, None, c["kts"], c["vts"], None),
         tensor_bytes),
        ("SDPA enable_gqa, no mask",
         lambda c: F.scaled_dot_product_attention(c["q"], c["k"], c["v"], enable_gqa=True), cache_bytes),
    ]
    if cache_bytes * HEADS_Q // HEADS_KV <= REPEAT_LIMIT:
        repeat = lambda t: t[:, :, None].expand(batch, HEADS_KV, HEADS_Q // HEADS_KV, context, DIM).reshape(
            batch, HEADS_Q, context, DIM)
        rows.append(("repeat_kv + SDPA, mask", lambda c: F.scaled_dot_product_attention(
            c["q"], repeat(c["k"]), repeat(c["v"]), attn_mask=c["mask"]), cache_bytes))
    if context == 4096:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
        rows.append(("FlexAttention, no mask", lambda c: flex(c["q"], c["k"], c["v"], enable_gqa=True), cache_bytes))
    q, k, v, mask = first["q"], first["k"], first["v"], first["mask"]
    quantized_after = next(fn for name, fn, _ in rows if name.endswith("then the row quantizer"))
    checks = {
        "fxquant bf16 cache, mask, output quantized": quantized_after(first),  # the same codes and scales, bit for bit
        "fxquant bf16 cache, mask": RA.decode_attention(q, k, v, mask, scale),
        "fxquant bf16 cache, mask, merge kernel": RA.decode_attention(q, k, v, mask, scale),
        "fxquant fp8 cache, mask": RA.decode_attention(q, first["kc"], first["vc"], mask, scale, k_scale=first["ks"],
                                                       v_scale=first["vs"]),
        "fxquant fp8 per-tensor, mask": RA.decode_attention(q, first["kt"], first["vt"], mask, scale,
                                                            k_scale=first["kts"], v_scale=first["vts"]),
    }
    return rows, sets, checks


def filled_paths(batch: int, context: int, filled: int):
    """paths() for a static cache of `context` keys holding `filled` (each sequence's first), the rest hidden by the
    mask: as transformers' boolean decode mask, whose hidden blocks the kernel does not read, and as an additive
    -inf mask hiding the same keys, whose blocks it reads; against a cache of the filled keys alone (the bytes that
    must be read) and SDPA over the boolean mask. Every row is checked against the fp32 reference: the additive
    mask compiles the kernel otherwise, so its bits may differ in the last place."""
    sets = cache_sets(batch, context)
    for (c,) in sets:
        c["seen"] = (torch.arange(context, device="cuda") < filled).expand(batch, 1, 1, context)
        c["hidden"] = torch.zeros(c["seen"].shape, device="cuda", dtype=torch.bfloat16).masked_fill(~c["seen"],
                                                                                                   float("-inf"))
        c["k_filled"], c["v_filled"] = c["k"][:, :, :filled], c["v"][:, :, :filled]
    scale = DIM**-0.5
    first = sets[0][0]
    filled_bytes = 2 * batch * HEADS_KV * filled * DIM * first["k"].element_size()
    codes_bytes = 2 * batch * HEADS_KV * filled * (DIM + 4)
    attn = torch.ops.fxquant.decode_attention
    rows = [
        ("fxquant bf16, boolean mask", lambda c: attn(c["q"], c["k"], c["v"], c["seen"], scale, 0.0, None, None,
                                                       None, None), filled_bytes),
        ("fxquant bf16, additive mask", lambda c: attn(c["q"], c["k"], c["v"], c["hidden"], scale, 0.0, None, None,
                                                        None, None), filled_bytes),
        ("fxquant fp8, boolean mask", lambda c: attn(c["q"], c["kc"], c["vc"], c["seen"], scale, 0.0, None, c["ks"],
                                                      c["vs"], None), codes_bytes),
        ("fxquant fp8, additive mask", lambda c: attn(c["q"], c["kc"], c["vc"], c["hidden"], scale, 0.0, None,
                                                       c["ks"], c["vs"], None), codes_bytes),
        ("SDPA enable_gqa, boolean mask", lambda c: F.scaled_dot_product_attention(
            c["q"], c["k"], c["v"], attn_mask=c["seen"], enable_gqa=True), filled_bytes),
    ]
    if filled < context:
        rows.insert(2, ("fxquant bf16, a cache of the filled keys", lambda c: attn(
            c["q"], c["k_filled"], c["v_filled"], None, scale, 0.0, None, None, None, None), filled_bytes))
    q, k, v, seen = first["q"], first["k"], first["v"], first["seen"]
    checks = {
        "fxquant bf16, boolean mask": RA.decode_attention(q, k, v, seen, scale),
        "fxquant fp8, boolean mask": RA.decode_attention(q, first["kc"], first["vc"], seen, scale,
                                                         k_scale=first["ks"], v_scale=first["vs"]),
    }
    checks["fxquant bf16, additive mask"] = checks["fxquant bf16, boolean mask"]
    checks["fxquant fp8, additive mask"] = checks["fxquant fp8, boolean mask"]
    return rows, sets, checks


# (programs per SM, key blocks per split, warps, keys per block[, pipeline stages])
# (more programs and one block a split: a cold cache at B1 wants bytes in flight, not few programs)
CANDIDATES = [(2, 4, 4, 64), (2, 2, 4, 64), (2, 2, 4, 128), (2, 4, 8, 128), (4, 2, 4, 64), (2, 8, 4, 64),
              (1, 4, 8, 128), (2, 4, 2, 64), (4, 1, 4, 64), (8, 1, 4, 64), (8, 1, 4, 32), (8, 2, 4, 64)]
# codes hold half the bytes a block: more programs and deeper pipelines keep as many bytes in flight. At 4 warps and
# about 250 registers a thread an SM holds two programs: one or three programs an SM asked at 128 pairs make whole
# waves of them (2 or 4 splits), where four (5 splits, 640 programs over 264 slots) leave the last wave 42% full.
CODES_CANDIDATES = [(4, 4, 2, 64), (8, 4, 2, 64), (4, 4, 4, 64), (2, 4, 2, 64, 3), (4, 4, 2, 64, 3),
                    (2, 4, 2, 128), (4, 4, 4, 128, 3), (8, 2, 2, 64, 3), (8, 1, 4, 128), (8, 1, 4, 64),
                    (8, 2, 4, 128), (1, 4, 4, 128, 3), (3, 4, 4, 128, 3), (1, 4, 4, 128, 4), (3, 4, 4, 128, 4)]


def sweep(batches, contexts, codes: bool) -> None:
    """The kernel's launch plans (programs per SM, key blocks per split, warps, keys per block) with the mask, on the
    bf16 cache or on e4m3 codes with per-token scales."""
    from fxquant.kernels.decode_attention import decode_attention

    rows = []
    for batch in batches:
        for context in contexts:
            sets = cache_sets(batch, context)
            k, v = ("kc", "vc") if codes else ("k", "v")
            row = {"B": batch, "context": context}
            for plan in CANDIDATES + (CODES_CANDIDATES if codes else []):
                fn = lambda c, plan=plan: decode_attention(c["q"], c[k], c[v], c["mask"], DIM**-0.5, 0.0, None,
                                                           c["ks"] if codes else None, c["vs"] if codes else None,
                                                           None, plan=plan)
                row[str(plan)] = f"{1e3 * graph_time_ms(fn, sets):.1f}"
            rows.append(row)
            print(row, flush=True)
            del sets
            torch.cuda.empty_cache()
    print(table(rows))


def split_sweep(batches, contexts, counts, codes: bool) -> None:
    """The kernel over e4m3 codes (per-token scales; `codes` false: over the bf16 cache), the mask on, at its default
    plan, with each split count of `counts` in place of the one it picks; the row "picked" is the kernel as it runs,
    its count beside it."""
    from fxquant.kernels.decode_attention import decode_attention, launch_plan

    rows = []
    for batch in batches:
        for context in contexts:
            sets = cache_sets(batch, context)
            row = {"B": batch, "context": context,
                   "splits picked": launch_plan(batch * HEADS_KV, context, codes, torch.device("cuda"))[1]}
            k, v, k_scale, v_scale = ("kc", "vc", "ks", "vs") if codes else ("k", "v", None, None)
            for splits in [None, *counts]:
                fn = lambda c, splits=splits: decode_attention(
                    c["q"], c[k], c[v], c["mask"], DIM**-0.5, 0.0, None, c.get(k_scale), c.get(v_scale), None,
                    splits=splits)
                row[str(splits or "picked")] = f"{1e3 * graph_time_ms(fn, sets):.1f}"
            rows.append(row)
            print(row, flush=True)
            del sets
            torch.cuda.empty_cache()
    print(table(rows))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--sweep", action="store_true", help="time the kernel's launch plans instead")
    parser.add_argument("--codes", action="store_true", help="sweep over an e4m3 cache")
    parser.add_argument("--splits", type=int, nargs="+", help="time the e4m3 cache's kernel at these split counts "
                        "(with --bf16, the bf16 cache's)")
    parser.add_argument("--bf16", action="store_true", help="--splits over the bf16 cache")
    parser.add_argument("--filled", type=int, help="the cache holds this many tokens of its context; a mask hides "
                        "the rest")
    args = parser.parse_args()
    print(header())
    if args.sweep:
        sweep(args.batches, args.contexts, args.codes)
        return
    if args.splits:
        split_sweep(args.batches, args.contexts, args.splits, codes=not args.bf16)
        return
    bandwidth = copy_bandwidth_gbs()
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    table_rows = []
    for batch in args.batches:
        for context in args.contexts:
            rows, sets, checks = (filled_paths(batch, context, min(args.filled, context)) if args.filled
                                  else paths(batch, context))
            row = {"B": batch, "context": context}
            for name, fn, nbytes in rows:
                out = fn(*sets[0])
                if isinstance(checks.get(name), tuple):  # (codes, scales): the bits of the unfused quantizer
                    same = all(torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                               for got, want in zip(out, checks[name], strict=True))
                    assert same, f"{name} at B{batch} {context}: other bits than the row quantizer's"
                elif name in checks:  # the same numbers as the fp32 reference, within bf16's rounding
                    want = checks[name].float()
                    err = float((out.float() - want).norm() / want.norm())
                    assert err < 1e-2, f"{name} at B{batch} {context}: relative error {err:.2e}"
                us = 1e3 * graph_time_ms(fn, sets)
                row[name] = f"{us:.1f} us, {100 * nbytes / (us * 1e-6) / (bandwidth * 1e9):.0f}%"
            table_rows.append(row)
            print(row, flush=True)
            del rows, sets, checks
            torch.cuda.empty_cache()
    print(table(table_rows))


if __name__ == "__main__":
    main()
