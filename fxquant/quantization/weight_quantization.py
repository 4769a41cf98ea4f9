"""Weight quantization for every path (the backend's pass, quantize_, the quantized modules, the measurements):
a weight quantized in chunks, bit for bit the whole-tensor result, its SQNR, and why a weight stays in high
precision. Below the passes: no pass is imported here."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor

from fxquant.config import AUTO, KEEP, RECIPES, LinearScheme, QuantConfig
from fxquant.numerics import reference as R
from fxquant.numerics.formats import E2M1, E4M3
from fxquant.numerics.metrics import row_sums, sqnrs_of_row_sums

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROUTER_REASON = "router: its output selects experts (top-k)"
CAST_REASON = "its product reads the weight cast to another dtype (logits wanted in that precision)"
SHARDED_REASON = ("a DTensor (tensor-parallel) weight not run on local shards: torch.compile(backend='fxquant') runs "
                  "column parallel over a replicated input and row parallel without bias, on a 1-D mesh, only")
SHARED_PREFIX = "its weight is shared with "


def shared_weight_reason(readers) -> str:
    """Why a linear stays in high precision when modules kept in it also read its weight (a tied lm_head)."""
    return f"{SHARED_PREFIX}{', '.join(dict.fromkeys(readers))}, which stays in high precision"


def untie_hint(fqn: str) -> str:
    """The fix for a shared weight that a layer_recipes entry asks to quantize: a weight of the layer's own."""
    return (f"to quantize it, give it a weight of its own before quantizing (`layer = model.get_submodule({fqn!r}); "
            "layer.weight = torch.nn.Parameter(layer.weight.detach().clone())`): the other readers keep the "
            "high-precision copy, so the model grows by the quantized weight")


SHARD_HINT = ("on this rank's shard of a tensor-parallel weight: shard on a multiple of the recipe's block (fewer "
              "ranks), or take a recipe with smaller blocks (fp8_row)")


# Elements quantized (and measured) at a time: the reference's fp32 temporaries (a dozen for the FP4 encoders, eight
# candidates' for the searched int4 scales) and the measure's fp64 ones stay a few MB a chunk, not copies of the
# whole weight. Whole 128-row blocks (fp8_block's), so each block's scale sees its whole block.
CHUNK_ELEMENTS = 2**21
BLOCK_ROWS = 128


def chunk_rows(k: int) -> int:
    """Rows of a [N, k] weight quantized at a time: CHUNK_ELEMENTS of them, in whole blocks of BLOCK_ROWS."""
    return max(BLOCK_ROWS, CHUNK_ELEMENTS // max(k, 1) // BLOCK_ROWS * BLOCK_ROWS)


def quantize_weight(w: torch.Tensor, recipe: str):
    """The recipe's quantized weight [N, K], or experts' [E, N, K] stacked expert by expert (codes, scale, global
    scale, zero point in one Quantized), `chunk_rows` rows at a time, bit for bit the whole-tensor result. A
    per-tensor scale (fp8_tensor, NVFP4's global scale) is computed first from the chunks' maxima and given to every
    chunk as a static scale; a per-tensor fp8 scale that a non-finite weight poisons is left to the whole-tensor
    pass, which spreads the poison as documented."""
    if w.dim() == 3:
        return R.stack_experts([quantize_weight(w[e], recipe) for e in range(w.shape[0])])
    scheme = RECIPES[recipe]
    # contiguous: a [K, N]-stored weight arrives as a transposed view, and the kernels read row-major codes.
    whole = lambda t, scale=None: R.quantize(t.detach().contiguous(), scheme.weight_fmt, scheme.weight_granularity,
                                             scale=scale, symmetric=scheme.symmetric, scale_mode=scheme.scale_mode)
    rows = chunk_rows(w.shape[1])
    if w.shape[0] <= rows:
        return whole(w)
    starts = range(0, w.shape[0], rows)
    scale = None
    if scheme.weight_fmt == "nvfp4":
        amax = torch.stack([R.nvfp4_global_amax(w[i:i + rows]) for i in starts]).amax()
        scale = R.scale_from_amax(amax, E4M3.max * E2M1.max)
    elif scheme.weight_granularity == "tensor":
        amax = torch.stack([R.block_amax(w[i:i + rows].reshape(1, -1).float())[0] for i in starts]).amax()
        if not torch.isfinite(amax):
            return whole(w)
        scale = R.scale_from_amax(amax, R.FP8[scheme.weight_fmt].max)
    chunks = [whole(w[i:i + rows], scale) for i in starts]

    def joined(field):
        first = getattr(chunks[0], field)
        if first is None or first.dim() == 0:
            return first  # absent, or the one scale every chunk was given
        return torch.cat([getattr(chunk, field) for chunk in chunks])

    return replace(chunks[0], shape=w.shape, data=joined("data"), scale=joined("scale"),
                   zero_point=joined("zero_point"), row_scale=joined("row_scale"))


def quantize_and_measure(w: torch.Tensor, recipe: str):
    """(quantized weight, weight SQNR, worst channel's SQNR): what a graph needs of a weight, kept in weight_store
    so a later graph of the model neither quantizes nor measures it again."""
    q = quantize_weight(w, recipe)
    return q, *weight_sqnrs(q, w)


def weight_sqnrs(q, w: torch.Tensor) -> tuple[float, float]:
    """(SQNR, worst output channel's SQNR) in dB of a weight [N, K], or experts [E, N, K] (each expert's channels
    rows too), quantized as q. Dequantized and compared `chunk_rows` rows at a time: fp64 temporaries of a few MB a
    chunk, where the whole weight's were four fp64 copies of it (1.9 GB for a 14336 x 4096 weight, quantize_'s peak
    at 1.58x the bf16 model's bytes before; bench/results/2026-12-07/quantize_peak_43cd460.txt)."""
    experts = [(R.expert(q, e), w[e]) for e in range(w.shape[0])] if w.dim() == 3 else [(q, w)]
    step = chunk_rows(w.shape[-1])
    sums = [row_sums(R.dequantize(part.rows(i, min(i + step, rows.shape[0])), torch.float32), rows[i:i + step])
            for part, rows in experts for i in range(0, rows.shape[0], step)]
    return sqnrs_of_row_sums(torch.cat([signal for signal, _ in sums]), torch.cat([noise for _, noise in sums]))


def weight_skip_reason(w, dims: int = 2) -> str | None:
    """Why no recipe can take this weight (`dims` dims: 2 for a linear's, 3 for experts'), or None."""
    if not isinstance(w, torch.Tensor) or w.dim() != dims:
        return f"weight is not a constant {dims}-D tensor"
    if w.dtype not in FLOAT_DTYPES:
        return f"weight dtype {w.dtype} is not a float"
    if isinstance(w, DTensor):
        return SHARDED_REASON
    return None


ALIGNMENT = "alignment:"


def alignment_reason(shape, scheme: LinearScheme) -> str | None:
    n, k = shape[-2:]
    if k % scheme.k_multiple or n % scheme.n_multiple:
        return (f"{ALIGNMENT} needs K % {scheme.k_multiple} == 0 and N % {scheme.n_multiple} == 0, "
                f"has [N={n}, K={k}]")
    return None


def skip_reason(w, fqn, config: QuantConfig, auto_reasons=None, dims: int = 2) -> str | None:
    """Why layer fqn (weight w as [N, K], or experts' [E, N, K]) stays in high precision under config, or None."""
    reason = weight_skip_reason(w, dims) or config.skip_reason(fqn)
    if reason:
        return reason
    if dims == 3 and config.recipe == AUTO and config.layer_recipe(fqn) is None:
        return ("recipe='auto' measured no recipe for these experts (they ran outside the graphs it measures): name "
                "one in layer_recipes")
    recipe = config.recipe_for(fqn)
    if recipe == KEEP:
        return (auto_reasons or {}).get(fqn, "layer_recipes keeps it in high precision")
    return alignment_reason(w.shape, RECIPES[recipe])
