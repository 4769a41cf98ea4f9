"""The rotary + cache write kernel against reference_rotary, bit for bit: q rotated, the cache rows written at their
positions and every other cache row untouched, for q and k read through the strided views a merged q/k/v GEMM's
output gives, cos and sin broadcast over the batch, several query positions and a head dim not a power of two."""

import pytest
import torch

from fxquant.kernels.rotary_cache import rotary_cache_write, supports, supports_codes
from fxquant.numerics import reference_rotary
from fxquant.ops import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def operands(B, HQ, HKV, Q, D, S, dtype, cos_batch, seed=0, cos_dtype=None):
    """q, k, v as views of one merged projection output [B, Q, (HQ + 2 HKV) D], as attention's reshapes make them;
    cos and sin [cos_batch, 1, Q, D] from angles of positions, as transformers' rotary embedding makes them."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, Q, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    q, k, v = (t.view(B, Q, -1, D).transpose(1, 2) for t in qkv.split([HQ * D, HKV * D, HKV * D], dim=-1))
    positions = torch.randperm(S, generator=gen)[:Q]
    freqs = positions[:, None].float() * torch.rand(D // 2, generator=gen)
    angles = torch.cat((freqs, freqs), dim=-1).expand(cos_batch, 1, Q, D)
    caches = [torch.randn(B, HKV, S, D, generator=gen).to(dtype) for _ in range(2)]
    cos, sin = angles.cos().to(cos_dtype or dtype), angles.sin().to(cos_dtype or dtype)
    moved = (t.to(DEVICE) for t in (q, k, v, cos, sin, positions, *caches))
    return tuple(moved)


@pytest.mark.parametrize("cos_dtype", [None, torch.float32], ids=["cos_as_q", "cos_fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(("B", "HQ", "HKV", "Q", "D", "cos_batch"), [
    (1, 4, 2, 1, 64, 1),    # a decode step, cos shared
    (3, 8, 2, 1, 128, 3),   # a batch, cos per sequence
    (2, 4, 4, 3, 96, 1),    # three positions, a head dim not a power of two, no grouping
])
def test_the_kernel_gives_the_references_bits(B, HQ, HKV, Q, D, cos_batch, dtype, cos_dtype):
    q, k, v, cos, sin, positions, k_cache, v_cache = operands(B, HQ, HKV, Q, D, 16, dtype, cos_batch,
                                                              cos_dtype=cos_dtype)
    assert supports(q, k, v, cos, sin, positions, k_cache, v_cache) is None
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference_rotary.rotary_cache_write(q, k, v, cos, sin, positions, want_k, want_v)
    got = rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache)
    assert got.is_contiguous() and got.shape == q.shape
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(k_cache.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(v_cache.view(torch.int16), want_v.view(torch.int16))
    rotated = reference_rotary.rotated(k, cos, sin)
    assert torch.equal(k_cache[:, :, positions], rotated) and torch.equal(v_cache[:, :, positions], v)
    assert not torch.equal(rotated, k)  # the rotation did something the check would see


def test_the_reference_is_transformers_rotation_computed_in_fp32():
    """The oracle is apply_rotary_pos_emb's formula: with cos and sin in bf16 its products are exact in fp32 as in
    fp64, so transformers' own expression evaluated in fp32 gives the same bits."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, _, cos, sin, *_ = operands(2, 4, 2, 1, 64, 16, torch.bfloat16, 2)
    want_q, want_k = apply_rotary_pos_emb(q.float(), k.float(), cos.float()[:, 0], sin.float()[:, 0])
    for x, want in ((q, want_q), (k, want_k)):
        assert torch.equal(reference_rotary.rotated(x, cos, sin), want.to(torch.bfloat16))


@pytest.mark.parametrize("cos_dtype", [None, torch.float32], ids=["cos_as_q", "cos_fp32"])
def test_half_width_cos_and_sin_serve_both_halves(cos_dtype):
    """GPT-OSS's spelling: cos and sin [.., D / 2] for both halves, the same rotation as the full-width ones."""
    q, k, v, cos, sin, positions, k_cache, v_cache = operands(2, 4, 2, 1, 64, 16, torch.bfloat16, 2,
                                                              cos_dtype=cos_dtype)
    half_cos, half_sin = cos[..., :32], sin[..., :32]  # the full-width ones repeat them: cat((freqs, freqs))
    assert torch.equal(torch.cat((half_cos, half_cos), -1), cos)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference_rotary.rotary_cache_write(q, k, v, cos, sin, positions, want_k, want_v)
    got = rotary_cache_write(q, k, v, half_cos, half_sin, positions, k_cache, v_cache)
    assert torch.equal(got, want) and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert "half as wide" in supports(q, k, v, cos[..., :16], sin[..., :16], positions, k_cache, v_cache)


def test_a_position_outside_the_cache_writes_nothing():
    q, k, v, cos, sin, _, k_cache, v_cache = operands(1, 4, 2, 2, 64, 16, torch.bfloat16, 1)
    positions = torch.tensor([16, 0, 3, 0], device=DEVICE)[::2]  # 16 is one past the end; a strided view
    before_k, before_v = k_cache.clone(), v_cache.clone()
    rotary_cache_write(q, k, v, cos, sin, positions, k_cache, v_cache)
    untouched = [s for s in range(16) if s != 3]
    assert torch.equal(k_cache[:, :, untouched], before_k[:, :, untouched])
    assert torch.equal(v_cache[:, :, untouched], before_v[:, :, untouched])
    assert torch.equal(v_cache[:, :, 3], v[:, :, 1])


def test_the_kernel_refuses_mixed_dtypes():
    q, k, v, cos, sin, positions, k_cache, v_cache = operands(1, 4, 2, 1, 64, 16, torch.bfloat16, 1)
    assert "both fp32" in supports(q, k, v, cos.float(), sin, positions, k_cache, v_cache)
    assert "not all bf16 or fp16" in supports(q, k.half(), v, cos, sin, positions, k_cache, v_cache)


@pytest.mark.parametrize(("B", "HQ", "HKV", "Q", "D"), [(1, 4, 2, 1, 64), (2, 8, 2, 3, 96)])
def test_an_e4m3_cache_gets_the_row_quantizers_codes_and_scales(B, HQ, HKV, Q, D):
    """The rows written into an e4m3 cache are quantize_fp8's of the rotated k and of v, bit for bit, at their
    positions (codes) and the twin layer's (scales); every other row untouched. Rows of a wide range of magnitudes
    (scaled by powers of two) exercise the scale per row."""
    q, k, v, cos, sin, positions, *_ = operands(B, HQ, HKV, Q, D, 16, torch.bfloat16, 1, cos_dtype=torch.float32)
    gen = torch.Generator().manual_seed(9)
    magnitudes = torch.exp2(torch.randint(-6, 8, (B, HKV, Q, 1), generator=gen)).to(DEVICE)
    k, v = (k * magnitudes).bfloat16(), (v * magnitudes.flip(2)).bfloat16()
    scale_positions = (positions + 1) % 16  # the twin layer's own count: here another position, to tell them apart
    caches = [torch.randint(0, 255, (B, HKV, 16, D), generator=gen, dtype=torch.uint8).to(DEVICE) for _ in range(2)]
    scales = [torch.rand(B, HKV, 16, 1, generator=gen).to(DEVICE) for _ in range(2)]
    want_caches, want_scales = [c.clone() for c in caches], [s.clone() for s in scales]
    assert supports(q, k, v, cos, sin, positions, *caches) is None and supports_codes(q, caches[0], *scales) is None
    want = reference_rotary.rotary_cache_write_e4m3(q, k, v, cos, sin, positions, scale_positions, *want_caches,
                                                    *want_scales)
    got = rotary_cache_write(q, k, v, cos, sin, positions, *caches, codes=(scale_positions, *scales))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for got_t, want_t in zip(caches + scales, want_caches + want_scales, strict=True):
        assert torch.equal(got_t.view(torch.uint8), want_t.view(torch.uint8))
    assert "beside the codes" in supports_codes(q, caches[0][:, :, :8], *scales)
    codes, scale = quantize_fp8(v, 0)
    assert torch.equal(caches[1][:, :, positions], codes.view(torch.uint8))
    assert torch.equal(scales[1][:, :, scale_positions], scale)


@pytest.mark.parametrize("codes", [False, True], ids=["bf16_cache", "e4m3_cache"])
@pytest.mark.parametrize("counted_in_kernel", [True, False], ids=["arrivals", "add_after"])
@pytest.mark.parametrize(("B", "HQ", "HKV", "Q", "D"), [(1, 4, 2, 1, 64), (2, 8, 2, 3, 96)])
def test_appending_writes_at_the_length_and_grows_it_once(B, HQ, HKV, Q, D, codes, counted_in_kernel):
    """append: the rows go where positions length + 0..Q-1 put them, codes and scales alike, and the length grows by
    Q exactly once, counted in the kernel by its last k/v row (whose arrival counter is left zero for the next
    kernel) or, without the split GEMMs' counters, by an add after it: the reference's bits either way."""
    from fxquant.kernels import splitk

    q, k, v, cos, sin, _, k_cache, v_cache = operands(B, HQ, HKV, Q, D, 16, torch.bfloat16, 1,
                                                      cos_dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    if codes:
        k_cache, v_cache = (torch.randint(0, 255, (B, HKV, 16, D), generator=gen, dtype=torch.uint8).to(DEVICE)
                            for _ in range(2))
    scales = [torch.rand(B, HKV, 16, 1, generator=gen).to(DEVICE) for _ in range(2)] if codes else []
    length = torch.tensor(7, device=DEVICE)
    state = [length, k_cache, v_cache, *scales]
    want_state = [t.clone() for t in state]
    if codes:
        want = reference_rotary.rotary_cache_append_e4m3(q, k, v, cos, sin, *want_state)
    else:
        want = reference_rotary.rotary_cache_append(q, k, v, cos, sin, *want_state)
    with splitk.reduce_in_gemm(counted_in_kernel):
        got = rotary_cache_write(q, k, v, cos, sin, length, k_cache, v_cache, append=True,
                                 codes=(length, *scales) if codes else None)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    for got_t, want_t in zip(state, want_state, strict=True):
        assert torch.equal(got_t.reshape(-1).view(torch.uint8), want_t.reshape(-1).view(torch.uint8))
    assert int(length) == 7 + Q and not torch.equal(k_cache[:, :, 7:7 + Q], torch.zeros_like(k_cache[:, :, :Q]))
    if counted_in_kernel:
        assert not splitk.counters(torch.device(DEVICE), 1).any()  # left zero, as every counting kernel leaves them


def test_a_length_must_be_one_integer():
    q, k, v, cos, sin, positions, k_cache, v_cache = operands(1, 4, 2, 2, 64, 16, torch.bfloat16, 1)
    assert "not one integer" in supports(q, k, v, cos, sin, positions, k_cache, v_cache, append=True)
    assert supports(q, k, v, cos, sin, positions[:1], k_cache, v_cache, append=True) is None
    assert "int32 or int64" in supports(q, k, v, cos, sin, positions.float(), k_cache, v_cache)
