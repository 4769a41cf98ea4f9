"""silu(gate) * up quantized to fp8 in one launch, against the unfused steps."""

import pytest
import torch
from fp8_cases import same_bits

import fxquant
from fxquant.kernels import silu_mul_quant

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def sample(shape, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-8, 8, shape[:-1] + (1,), generator=gen))
    return x.to(dtype).to(DEVICE)


def merged_gate_up(tokens: int, width: int, dtype, poisoned=None):
    """gate and up as slices of one merged [tokens, 2 width] output, as merge_linear leaves them; `poisoned`: (token,
    value) written into that token's up."""
    merged = torch.cat([sample((tokens, width), dtype, seed=1), sample((tokens, width), dtype, seed=2)], dim=-1)
    if poisoned is not None:
        merged[poisoned[0], width + 5] = poisoned[1]
    return merged[..., :width], merged[..., width:]


def unfused(gate, up, group):
    """silu(gate) * up rounded to the activations' dtype, then the reference quantizer."""
    g = gate.float()
    h = (g * torch.sigmoid(g) * up.float()).to(gate.dtype)
    return fxquant.quantize(h, "fp8_e4m3", ("group", group) if group else "token", impl="reference")


def check_against_unfused(codes, scale, ref, row_len):
    """Bits on the CPU. On the GPU tl.sigmoid's exp is approximate, so a code may move by one e4m3 step."""
    if DEVICE == "cpu":
        assert same_bits(codes, ref.data) == 0
        assert torch.equal(scale.reshape(ref.scale.shape).nan_to_num(-1.0), ref.scale.nan_to_num(-1.0))
        return
    ours = codes.float() * scale.repeat_interleave(row_len, -1)
    theirs = ref.data.float() * ref.scale.reshape(scale.shape).repeat_interleave(row_len, -1)
    finite = theirs.isfinite()
    step = 2**-9 * float(scale.nan_to_num(0).max())  # e4m3's smallest subnormal at the largest scale
    assert torch.allclose(ours[finite], theirs[finite], rtol=2**-3, atol=step)  # one e4m3 step


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("group", [0, 128], ids=["token", "1x128"])
def test_silu_times_up_quantized_in_one_kernel_matches_the_two_steps(dtype, group):
    """Rows of 384, one program a row. A NaN in up poisons its quantizer row, and only it. Under the interpreter
    silu's exp is numpy's and torch's sigmoid is its own: equal bits at these seeds."""
    gate, up = merged_gate_up(6, 384, dtype, poisoned=(5, float("nan")))
    gate, up = gate.reshape(2, 3, 384), up.reshape(2, 3, 384)
    codes, scale = silu_mul_quant.silu_mul_quantize_fp8_rows(gate, up, group or 384)
    assert bool(scale[1, 2, 0].isnan()) and bool(codes[1, 2, :group or 384].float().isnan().all())  # its row only
    assert not bool(scale[0].isnan().any())
    check_against_unfused(codes, scale, unfused(gate, up, group), group or 384)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("tokens, poisoned", [(1, None), (1, (0, float("inf"))), (3, (1, float("nan")))],
                         ids=["one token", "one token, inf", "three tokens, one NaN"])
def test_a_token_s_whole_row_in_one_program(dtype, tokens, poisoned):
    """Decode's shape: one scale per token over a row of 4480, each row its amax at its very end (a program that
    missed the row's tail would take a smaller one). A NaN or inf poisons its token's row alone."""
    width = 4480
    gate, up = merged_gate_up(tokens, width, dtype, poisoned)
    gate[:, -1], up[:, -1] = 4.0, up[:, -1].abs().amax() * 64
    codes, scale = silu_mul_quant.silu_mul_quantize_fp8_rows(gate, up, width)
    for token in range(tokens):
        hit = poisoned is not None and token == poisoned[0]
        assert bool(scale[token].isnan()) == hit and bool(codes[token].float().isnan().all()) == hit
    check_against_unfused(codes, scale, unfused(gate, up, 0), width)


@pytest.mark.parametrize("case", ["shapes", "row_len", "dtype"])
def test_what_the_quantizer_refuses_is_named(case):
    """Each refusal differs from an accepted call in one thing: gate and up of two shapes, a row length that does not
    divide the row, a target dtype that is not fp8."""
    gate, up = merged_gate_up(2, 384, torch.bfloat16)
    args = {"shapes": (gate, up[:1], 384), "row_len": (gate, up, 100), "dtype": (gate, up, 384, torch.float16)}[case]
    silu_mul_quant.silu_mul_quantize_fp8_rows(gate, up, 384)  # accepted
    with pytest.raises(ValueError, match=r"silu\(gate\) \* up quantized in rows of .* an fp8 dtype; got"):
        silu_mul_quant.silu_mul_quantize_fp8_rows(*args)
