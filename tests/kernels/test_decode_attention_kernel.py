"""Split-KV decode attention (Triton) against reference_attention, on random data: lengths that do not divide the
key block or the split (1, 17, 300, 4095), masked rows, a cache read through strides, e4m3 codes, soft-capping,
sinks and sequence lengths. Bounds: the kernel rounds the probabilities to the cache's dtype for the product with
V (as flash attention does), about 2^-9 relative in bf16; in fp32 it is exact but for summation order."""

import pytest
import torch

from fxquant.kernels.decode_attention import (
    SHORT_PLAN,
    decode_attention,
    launch_plan,
    num_splits,
    supports,
    whole_wave_splits,
)
from fxquant.kernels.launch import cdiv
from fxquant.numerics import reference_attention as RA

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}  # relative error of the output


def rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def operands(batch, heads_q, heads_kv, queries, keys, dim, dtype, seed=0, max_len=None):
    """q [B, Hq, Q, D] and a cache [B, Hkv, S, D] cut from a larger static cache when max_len is given (strided)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads_q, queries, dim, generator=gen).to(dtype)
    big = torch.randn(2, batch, heads_kv, max_len or keys, dim, generator=gen).to(dtype).to(DEVICE)
    return q.to(DEVICE), big[0, :, :, :keys], big[1, :, :, :keys]  # views: strided where max_len > keys


def check(q, k, v, dtype, **kwargs):
    scale = q.shape[-1] ** -0.5
    args = dict(mask=None, scale=scale, softcap=0.0, sinks=None, k_scale=None, v_scale=None, kv_lens=None) | kwargs
    assert supports(q, k, v, args["mask"]) is None
    got = decode_attention(q, k, v, **args)
    want = RA.decode_attention(q, k, v, **args)
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < BOUND[dtype], rel_err(got, want)
    return got, want


@pytest.mark.parametrize("keys", [1, 17, 300])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)], ids=["gqa2", "gqa8"])
@pytest.mark.parametrize("queries", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_matches_reference(keys, heads, queries, dtype):
    q, k, v = operands(2, *heads, queries, keys, 64, dtype)
    check(q, k, v, dtype)


def test_a_long_cache_read_through_strides_in_many_splits():
    """4095 keys of a static cache allocated for 4224, split across programs: every split merged."""
    q, k, v = operands(1, 4, 2, 1, 4095, 64, torch.bfloat16, max_len=4224)
    assert not k.is_contiguous() and num_splits(2, 4095, q.device) > 8
    check(q, k, v, torch.bfloat16)


@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_a_left_padded_batch_with_a_sliding_window(kind):
    """transformers' mask [B, 1, Q, S]: batch row 0 left-padded by 5, row 1 sees a window of the last 16 keys, and
    keys past the filled length hidden; a boolean mask hides the same keys."""
    keys, filled = 80, 70
    q, k, v = operands(2, 4, 2, 2, keys, 64, torch.bfloat16, seed=1)
    seen = torch.zeros(2, 1, 2, keys, dtype=torch.bool)
    seen[0, :, :, 5:filled] = True
    seen[1, :, :, filled - 16:filled] = True
    seen[:, :, 0, filled - 1] = False  # the first query position does not see the second's key
    mask = seen if kind == "boolean" else torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.bfloat16).min)
    check(q, k, v, torch.bfloat16, mask=mask.to(DEVICE) if kind == "boolean" else mask.to(torch.bfloat16).to(DEVICE))


def test_a_row_with_every_key_masked_is_zero_not_nan():
    q, k, v = operands(2, 4, 2, 1, 33, 64, torch.bfloat16)
    seen = torch.ones(2, 1, 1, 33, dtype=torch.bool)
    seen[1] = False
    got, _ = check(q, k, v, torch.bfloat16, mask=seen.to(DEVICE))
    assert torch.equal(got[1], torch.zeros_like(got[1]))


def test_softcap_sinks_and_sequence_lengths():
    """Gemma2's soft-capping, GPT-OSS's sinks, and each sequence's filled length bounding the keys read."""
    q, k, v = operands(2, 8, 2, 1, 150, 64, torch.bfloat16, seed=2)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    lens = torch.tensor([150, 61], dtype=torch.int32, device=DEVICE)
    check(q, k, v, torch.bfloat16, softcap=5.0, sinks=sinks, kv_lens=lens)


@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_a_mask_shared_by_every_query_row_is_read_once_per_key(kind):
    """transformers' decode mask [B, 1, 1, S] (one position, every head) takes the per-key load; the same mask
    materialized per head takes the per-row one; both give the reference's result (on the GPU the two compile to
    different instruction orders, so they may differ from each other by a rounding). Keys 301: no multiple of 16."""
    q, k, v = operands(2, 8, 2, 1, 301, 64, torch.bfloat16, seed=8)
    hidden = torch.rand(2, 1, 1, 301, generator=torch.Generator().manual_seed(9)) < 0.3
    hidden[..., -1] = False  # every row attends to something
    mask = ~hidden if kind == "boolean" else torch.zeros(hidden.shape).masked_fill(hidden, float("-inf"))
    mask = mask.to(DEVICE) if kind == "boolean" else mask.to(DEVICE, torch.bfloat16)
    check(q, k, v, torch.bfloat16, mask=mask)
    check(q, k, v, torch.bfloat16, mask=mask.expand(2, 8, 1, 301).contiguous())


@pytest.mark.parametrize("codes", [False, True], ids=["bf16", "e4m3"])
def test_keys_a_boolean_mask_hides_past_the_filled_ones_are_never_read(codes):
    """A static cache larger than what it holds: the decode mask hides its unfilled tail, and the kernel reads no
    block of it. NaN written there (what torch.empty may hold) leaves the output finite and with the bits it has over
    zeros; read, a NaN value times its probability of 0 would be NaN. Batch row 1 is left-padded: its first keys are
    masked and, sharing a block with attended ones, read, as before."""
    keys, filled = 700, (70, 300)
    q, k, v = operands(2, 8, 2, 1, keys, 64, torch.bfloat16, seed=12)
    seen = torch.zeros(2, 1, 1, keys, dtype=torch.bool)
    seen[0, ..., :filled[0]] = True
    seen[1, ..., 5:filled[1]] = True
    outs = []
    for tail in (0.0, float("nan")):
        k2, v2 = k.clone(), v.clone()
        for row, length in enumerate(filled):
            k2[row, :, length:], v2[row, :, length:] = tail, tail
        scales = {}
        if codes:
            (k2, ks), (v2, vs) = fp8_cache(k2), fp8_cache(v2)
            scales = dict(k_scale=ks, v_scale=vs)
        mask = seen.to(DEVICE)
        outs.append(decode_attention(q, k2, v2, mask, q.shape[-1] ** -0.5, 0.0, None, kv_lens=None,
                                     **({"k_scale": None, "v_scale": None} | scales)))
        if tail == 0.0:
            want = RA.decode_attention(q, k2, v2, mask, q.shape[-1] ** -0.5, 0.0, None,
                                       **({"k_scale": None, "v_scale": None} | scales))
            assert rel_err(outs[0], want) < BOUND[torch.bfloat16]
    assert torch.isfinite(outs[1]).all() and torch.equal(outs[1], outs[0])


def test_a_sequence_shorter_than_a_slice_s_start_under_a_boolean_mask():
    """Sequence lengths and a boolean mask at once: row 1 ends (61 keys) before most slices start, so those slices
    attend to nothing; none may read the keys of the slice before it."""
    q, k, v = operands(2, 8, 2, 1, 700, 64, torch.bfloat16, seed=13)
    programs_per_sm, blocks_per_split, _, block_n = SHORT_PLAN  # the plan up to 4096 keys
    assert num_splits(2 * 2, 700, q.device, programs_per_sm, blocks_per_split, block_n) > 4  # slices of <= 128 keys
    seen = torch.ones(2, 1, 1, 700, dtype=torch.bool)
    seen[0, ..., 650:] = False
    check(q, k, v, torch.bfloat16, mask=seen.to(DEVICE), kv_lens=torch.tensor([700, 61], dtype=torch.int32,
                                                                             device=DEVICE))


def fp8_cache(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = t.float().abs().amax(-1).clamp_min(2**-9) / 448
    return (t.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("per_token", [True, False], ids=["per_token", "per_tensor"])
def test_an_fp8_cache_of_codes_and_scales(per_token):
    """e4m3 codes with fp32 scales: the scales folded into the scores and probabilities, the codes widened
    exactly; against the reference on the same codes."""
    q, k, v = operands(2, 4, 2, 1, 130, 64, torch.bfloat16, seed=4)
    quantized = []
    for t in (k, v):
        if per_token:
            quantized.append(fp8_cache(t))
        else:
            scale = t.float().abs().amax().reshape(1).clamp_min(2**-9) / 448  # amax / e4m3's max, floored
            quantized.append(((t.float() / scale).to(torch.float8_e4m3fn), scale))
    (kc, ks), (vc, vs) = quantized
    got, _ = check(q, kc, vc, torch.bfloat16, k_scale=ks, v_scale=vs)
    assert rel_err(got, RA.decode_attention(q, k, v)) < 0.1  # and near the unquantized cache's result


def test_codes_meet_queries_past_fp16s_range_and_values_far_below_it():
    """The codes' products run in fp16: each query row is scaled to |q| <= 1 by a power of two, and the
    probabilities by the largest value scale of their block, so a query of 1e6 does not overflow and values of
    1e-6 do not underflow. Rows of one tile differ by 1e10 in magnitude."""
    q, k, v = operands(2, 4, 2, 1, 130, 64, torch.bfloat16, seed=6)
    q = q * torch.tensor([1e6, 1e-4, 1.0, 3e3], dtype=q.dtype, device=q.device)[None, :, None, None]
    (kc, ks), (vc, vs) = fp8_cache(k), fp8_cache(v * 1e-6)
    check(q, kc, vc, torch.bfloat16, k_scale=ks, v_scale=vs)


def needle_in_noise(heads_q, heads_kv, keys, dim, seed):
    """q, and a cache of N(0, 1) noise holding one needle for query head 0: a key along its query whose score is
    the log of the noise's summed weight (so it takes about half of that head's attention) and a value of 4s.
    Returns (q, k, v, the needle's position)."""
    q, k, v = operands(1, heads_q, heads_kv, 1, keys, dim, torch.float32, seed=seed)
    scale = dim ** -0.5
    noise_weight = torch.logsumexp((q[0, 0, 0] @ k[0, 0].T) * scale, 0)
    at = keys * 3 // 4
    k[0, 0, at] = q[0, 0, 0] * noise_weight / (q[0, 0, 0].pow(2).sum() * scale)
    v[0, 0, at] = 4.0
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), at


@pytest.mark.parametrize("keys, heads, dim", [
    (16384, (4, 1), 64),  # under the interpreter too
    pytest.param(131072, (32, 8), 128, marks=pytest.mark.gpu),  # Llama-3-8B's heads at 128k
], ids=["16k", "128k_llama"])
def test_a_needle_far_back_in_a_long_fp8_cache_keeps_its_weight(keys, heads, dim):
    """Long-context accuracy over e4m3 codes (an fp8 cache's accumulation error once took a serving engine's
    needle-in-a-haystack score from 91% to 13%): across every split and the merge, the kernel gives the reference's
    attention over the same codes, and the needle keeps its half of head 0's attention as it does over bf16."""
    q, k, v, at = needle_in_noise(*heads, keys, dim, seed=11)
    (kc, ks), (vc, vs) = fp8_cache(k), fp8_cache(v)
    assert launch_plan(heads[1], keys, True, q.device)[1] > 8  # the codes' splits
    got, _ = check(q, kc, vc, torch.bfloat16, k_scale=ks, v_scale=vs)
    over_bf16 = RA.decode_attention(q, k, v)
    needle = got[0, 0, 0].float().mean() / 4.0  # the needle's share of head 0's output (the noise averages ~0)
    assert 0.4 < needle < 0.6, needle
    assert rel_err(got[0, 0], over_bf16[0, 0]) < 0.05, rel_err(got[0, 0], over_bf16[0, 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.gpu
def test_llama_3_8b_heads_at_4k_on_the_gpu(dtype):
    q, k, v = operands(4, 32, 8, 1, 4096, 128, dtype, seed=5)
    check(q, k, v, dtype)


@pytest.mark.gpu
def test_llama_3_8b_heads_at_4k_over_an_fp8_cache_on_the_gpu():
    q, k, v = operands(4, 32, 8, 1, 4096, 128, torch.bfloat16, seed=5)
    (kc, ks), (vc, vs) = fp8_cache(k), fp8_cache(v)
    check(q, kc, vc, torch.bfloat16, k_scale=ks, v_scale=vs)


def test_splits_over_codes_fill_whole_waves_of_the_programs_an_sm_holds():
    """B16 at 8 KV heads (128 pairs) on 132 SMs holding two programs each: 2 splits (256 programs, one wave 97%
    full), where rounding up to 4 programs an SM gave 5 (640, a third wave 42% full). Each count fills its waves
    to 95% or is the best any count up to the limit does, and is the fewest that does."""
    assert whole_wave_splits(128, 264, 32) == 2
    assert whole_wave_splits(192, 264, 32) == 4  # B24: 768 programs, three waves 97% full
    assert whole_wave_splits(1, 264, 64) == 64  # one pair fills no wave: the most splits it may take
    fill = lambda pairs, s: pairs * s / (cdiv(pairs * s, 264) * 264)
    for pairs in range(1, 600, 7):
        for most in (1, 2, 8, 33, 64):
            picked = whole_wave_splits(pairs, 264, most)
            fills = [fill(pairs, s) for s in range(1, most + 1)]
            assert 1 <= picked <= most
            assert fill(pairs, picked) >= 0.95 or fill(pairs, picked) == max(fills)
            assert all(f < 0.95 for f in fills[:picked - 1])
    # the kernel's own count off the GPU (132 SMs): Llama-3-8B's heads at B16 over 16k keys of codes
    assert launch_plan(16 * 8, 16384, True, torch.device("cpu"))[1] == 2
    assert launch_plan(16 * 8, 16384, False, torch.device("cpu"))[1] > 2  # a bf16 cache's plans as they were


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [16, 24])
def test_llama_3_8b_heads_over_an_fp8_cache_in_whole_waves_on_the_gpu(batch):
    """The codes' plan from 128 pairs, at the split counts whole waves give (2 and 4 on 132 SMs)."""
    q, k, v = operands(batch, 32, 8, 1, 2048, 128, torch.bfloat16, seed=5)
    (kc, ks), (vc, vs) = fp8_cache(k), fp8_cache(v)
    check(q, kc, vc, torch.bfloat16, k_scale=ks, v_scale=vs)


def test_operands_it_does_not_serve_are_said():
    q, k, v = operands(1, 4, 2, 1, 16, 64, torch.bfloat16)
    refusal = lambda *args: supports(*args) or ""
    assert "head dim 48" in refusal(q[..., :48].contiguous(), k[..., :48], v[..., :48], None)
    assert "torch.float32" in refusal(q, k.float(), v.float(), None)  # a cache in another dtype
    assert "not contiguous" in refusal(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, None)
    assert "over 16 cached positions" in refusal(q, k, v, torch.zeros(1, 1, 1, 8))
    assert "3 query heads over 2" in refusal(q[:, :3], k, v, None)


def test_the_op_runs_the_kernel_or_the_reference_and_passes_opcheck():
    import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)

    q, k, v = operands(2, 4, 2, 1, 40, 64, torch.bfloat16)
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bfloat16, device=DEVICE)
    args = (q, k, v, mask, 0.125, 0.0, None, None, None, None)
    torch.library.opcheck(torch.ops.fxquant.decode_attention.default, args)
    got = torch.ops.fxquant.decode_attention(*args)
    assert rel_err(got, RA.decode_attention(q, k, v, mask, 0.125)) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("group", [0, 64, 16], ids=["per_token", "group64", "group16"])
def test_the_quantized_op_is_attention_then_the_quantizer_and_passes_opcheck(group):
    """fxquant.decode_attention_quantize_fp8 gives quantize_fp8's bits of decode_attention's output laid out for the
    o-projection: on the GPU through the kernel's quantizing merge, on the CPU through the references."""
    import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)

    q, k, v = operands(2, 4, 2, 1, 40, 64, torch.bfloat16, seed=5)
    mask = torch.zeros(2, 1, 1, 40, dtype=torch.bfloat16, device=DEVICE)
    args = (q, k, v, mask, 0.125, 0.0, None, None, None, None)
    torch.library.opcheck(torch.ops.fxquant.decode_attention_quantize_fp8.default, (*args, group),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    codes, scales = torch.ops.fxquant.decode_attention_quantize_fp8(*args, group)
    out = torch.ops.fxquant.decode_attention(*args)
    want_codes, want_scales = torch.ops.fxquant.quantize_fp8(out.transpose(1, 2).reshape(2, 1, 256), group)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)


MERGED_CASES = {  # (batch, query heads, KV heads, queries, keys, extra arguments' maker)
    "many splits": (1, 4, 2, 1, 4095, lambda q, k, v: {}),
    "sinks and lengths": (2, 8, 2, 1, 150, lambda q, k, v: dict(
        sinks=torch.linspace(-1, 2, 8, device=DEVICE), kv_lens=torch.tensor([150, 61], device=DEVICE))),
    "five positions, 20 rows a pair": (1, 8, 2, 5, 700, lambda q, k, v: {}),
    "e4m3 codes": (2, 4, 2, 1, 300, lambda q, k, v: dict(
        zip(("k", "k_scale", "v", "v_scale"), (*fp8_cache(k), *fp8_cache(v)), strict=True))),
}


@pytest.mark.parametrize("name", MERGED_CASES)
def test_the_last_split_merges_the_merge_kernel_s_bits_and_leaves_the_counters_zero(name, monkeypatch):
    """Where the pairs have counters, the split that finishes last merges its pair, and no merge kernel runs; its
    output is the merge kernel's, bit for bit, twice in a row (the counters are zero again after each call)."""
    from fxquant.kernels import decode_attention as DA
    from fxquant.kernels import splitk

    batch, heads_q, heads_kv, queries, keys, extra = MERGED_CASES[name]
    q, k, v = operands(batch, heads_q, heads_kv, queries, keys, 64, torch.bfloat16, seed=len(name))
    args = dict(q=q, k=k, v=v, mask=None, scale=0.125, softcap=0.0, sinks=None, k_scale=None, v_scale=None,
                kv_lens=None) | extra(q, k, v)
    launched = []
    launch = DA.visible
    monkeypatch.setattr(DA, "visible", lambda kernel: launched.append(kernel.__name__) or launch(kernel))
    with splitk.reduce_in_gemm(False):  # no counters: the merge kernel
        want = decode_attention(**args)
    assert launched == ["_decode_attention_split_kernel", "_decode_attention_merge_kernel"]
    got, again = decode_attention(**args), decode_attention(**args)
    assert launched[2:] == ["_decode_attention_split_kernel"] * 2
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want) and torch.equal(again, want)
    assert not splitk.counters(q.device, 1).any()  # the buffer the kernel counted on (cuda:0, not "cuda")
    assert rel_err(got, RA.decode_attention(**args)) < BOUND[torch.bfloat16]


QUANTIZED_CASES = {  # (batch, query heads, KV heads, queries, keys, extra arguments' maker)
    "two KV heads": (2, 4, 2, 1, 300, lambda q, k, v: {}),
    "three positions, rows of 384": (2, 6, 2, 3, 150, lambda q, k, v: {}),  # a token row not a power of two
    "e4m3 codes with lengths": (2, 4, 2, 1, 200, lambda q, k, v: dict(
        zip(("k", "k_scale", "v", "v_scale"), (*fp8_cache(k), *fp8_cache(v)), strict=True),
        kv_lens=torch.tensor([200, 77], device=DEVICE))),
}


@pytest.mark.parametrize("group", [0, 32, 64], ids=["per_token", "group32", "group64"])
@pytest.mark.parametrize("name", QUANTIZED_CASES)
def test_the_kernel_quantizes_its_output_with_the_quantizer_s_bits(name, group, monkeypatch):
    """Quantized as it merges, the output's codes and scales are quantize_fp8's of the stored output, laid out as
    the o-projection reads it, bit for bit: per token by each batch row's last pair to merge, in groups within a
    head's row at once. One kernel runs, twice in a row (every counter zero again after each call); without
    counters the output is stored and quantized by the quantizer's kernel, to the same bits."""
    from fxquant.kernels import decode_attention as DA
    from fxquant.kernels import splitk
    from fxquant.kernels.quant_fp8 import quantize_fp8_rows

    batch, heads_q, heads_kv, queries, keys, extra = QUANTIZED_CASES[name]
    q, k, v = operands(batch, heads_q, heads_kv, queries, keys, 64, torch.bfloat16, seed=len(name) + group)
    args = dict(q=q, k=k, v=v, mask=None, scale=0.125, softcap=0.0, sinks=None, k_scale=None, v_scale=None,
                kv_lens=None) | extra(q, k, v)
    width = heads_q * 64
    out = decode_attention(**args)
    want_codes, want_scales = quantize_fp8_rows(out.transpose(1, 2).reshape(batch, queries, width), group or width)
    assert torch.isfinite(want_scales).all() and out.abs().max() > 0
    launched = []
    launch = DA.visible
    monkeypatch.setattr(DA, "visible", lambda kernel: launched.append(kernel.__name__) or launch(kernel))
    results = [DA.decode_attention_quantized(*args.values(), group) for _ in range(2)]
    with splitk.reduce_in_gemm(False):  # no counters: stored, then the quantizer's kernel
        results.append(DA.decode_attention_quantized(*args.values(), group))
    assert launched == ["_decode_attention_split_kernel"] * 3 + ["_decode_attention_merge_kernel"]
    for codes, scales in results:
        assert codes.shape == (batch, queries, width) and scales.shape == want_scales.shape
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scales, want_scales)
    assert not splitk.counters(q.device, 1).any()  # the pairs' counters and the batch rows'
