"""The numerics lint: what would fail silently, found once per compile on the graph and its real weights.

Severities: "error" means running would produce inf/NaN, so compile refuses (`NumericsError`); "warning" is a
likely bug that runs (warned once per compile); "info" goes in the report only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from fxquant.compile.weights import ROLES
from fxquant.config import KEEP, RECIPES
from fxquant.numerics.formats import FORMATS
from fxquant.ops.linear import reference_reason
from fxquant.passes.annotations import annotation, fetch_attr, linear_fqn, node_dtype
from fxquant.passes.patterns import weight_operands
from fxquant.passes.spellings import DIV, DTYPE_CASTS, MUL, target_of
from fxquant.quantization.linear_ops import weight_group
from fxquant.quantization.weight_quantization import SHARED_PREFIX, untie_hint

FP16_MAX = FORMATS["fp16"].max
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
SCALE_OPS = DIV | MUL | {torch.Tensor.__mul__}
GEMM_TILE = 128  # the fp8 GEMM's K and N tile: a remainder runs masked tail tiles
# Worst-channel weight SQNR below which outliers have made a layer's scales coarse: well under what well-scaled
# weights get in their worst channel (fp8 ~31 dB, MXFP8's power-of-two scales 24-30, int8 per channel ~40, 4-bit
# formats ~17-20; all-MiniLM-L6-v2 and random nn.Linear inits), so only a real outlier problem crosses it.
WEIGHT_SQNR_FLOOR_DB = {"fp8_e4m3": 20.0, "mxfp8": 20.0, "int8": 20.0, "int4": 10.0, "mxfp4": 10.0, "nvfp4": 10.0}


@dataclass(frozen=True)
class Finding:
    severity: str  # "error", "warning" or "info"
    kind: str  # nonfinite_weight, fp16_weight, fp8_cast, fp16_overflow, weight_sqnr, slow_path, skipped, tail,
    # upcast, fused_norm, decode_attention, attention_left, experts
    where: str  # layer or node name
    message: str  # what is wrong and the fix


class NumericsError(ValueError):
    """Compile refused: running the graph as quantized would produce inf or NaN."""


def warn_findings(findings: list[Finding], stacklevel: int) -> None:
    """One warning listing every warning-level finding, if any."""
    found = [f for f in findings if f.severity == "warning"]
    if found:
        warnings.warn("fxquant numerics lint:\n" + "\n".join(f"  {f.where}: {f.message}" for f in found),
                      stacklevel=stacklevel + 1)


def refuse_errors(findings: list[Finding], what: str) -> None:
    """NumericsError listing every error-level finding, if any: `what` (compile, quantize_) would produce inf/NaN."""
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        raise NumericsError(f"fxquant: refusing to {what}, running would produce inf/NaN:\n"
                            + "\n".join(f"  {f.where}: {f.message}" for f in errors))


def lint_graph(gm: torch.fx.GraphModule, example_inputs=None) -> list[Finding]:
    """Findings on the prepared (frozen, annotated, upcast) graph, before quantization.

    example_inputs (real tensors) enable the activation checks: fp16 layers whose outputs overflow.
    """
    findings = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = dict(zip(placeholders, example_inputs or (), strict=False))  # e.g. a scale buffer's real value
    for node in gm.graph.nodes:
        found = annotation(node)
        if found is not None and found.kind in ("linear", "experts"):
            findings += _weight_findings(node, fetch_attr(gm, weight_operands(node).weight))
        findings += _fp8_cast_findings(gm, node, values)
    findings += _routing_findings(gm)
    if example_inputs is not None and any(_linear_dtype(n) == torch.float16 for n in gm.graph.nodes):
        findings += _fp16_activation_findings(gm, example_inputs)
    return findings


GEMM_MIN = 16  # the tensor cores' smallest tile side


def lint_layers(state, weights=()) -> list[Finding]:
    """Findings from what the pipeline did (its PipelineState): skipped layers and why, masked tails, reductions
    moved to fp32, norms fused with their fp8 quantizers, decode attention on fxquant's kernel and where it was
    left, with why; and the weight bytes no recipe covers (3-D experts)."""
    findings = _expert_findings(weights)
    for layer in state.layers:
        if layer.recipe is None:
            # A layer of fewer than 16 outputs or inputs (a shared expert's scalar gate) holds no bytes worth a
            # warning on every compile; the report still lists it.
            misaligned = layer.reason.startswith("alignment") and min(layer.shape[-2:], default=0) >= GEMM_MIN
            # A recipe asked for by name and not given, where the user can give the layer a weight of its own: a
            # warning with that fix, not a line in a report they may not print.
            asked = state.config.layer_recipe(layer.fqn)
            untie = asked not in (None, KEEP) and SHARED_PREFIX in layer.reason
            message = f"stays in high precision: {layer.reason}"
            if untie:
                message += f", although layer_recipes asks for {asked}; {untie_hint(layer.fqn)}"
            findings.append(Finding("warning" if misaligned or untie else "info", "skipped", layer.fqn, message))
            continue
        fmt = RECIPES[layer.recipe].weight_fmt
        worst = layer.worst_row_sqnr
        if worst is not None and worst < WEIGHT_SQNR_FLOOR_DB[fmt]:
            findings.append(Finding("warning", "weight_sqnr", layer.fqn, f"an output channel's weight SQNR is "
                                    f"{worst:.1f} dB under {layer.recipe}, far below what {fmt} keeps for a "
                                    f"well-scaled weight (floor {WEIGHT_SQNR_FLOOR_DB[fmt]:g} dB): outliers make its "
                                    "scales coarse (or, with power-of-two MX scales, clip it). Fix: fp8_row or "
                                    "fp8_block, or skip this layer"))
        slow = _reference_reason(layer)
        if slow:
            # A warning where the weight is on the GPU; on the CPU, where every product runs the reference, the report
            # says it (fp32 models are the CPU's usual case).
            severity = "warning" if layer.device.type == "cuda" else "info"
            dtype = str(layer.dtype).removeprefix("torch.")
            findings.append(Finding(severity, "slow_path", layer.fqn, f"{layer.recipe} on {dtype} activations runs "
                                    f"the pure-torch reference, on the GPU too: {slow} (an fp16 Llama's mxfp8 prefill "
                                    "took 14x as long there). Fix: run the model in bf16, or choose a recipe whose "
                                    "kernels take it (fp8_block quantizes activations in rows of 128)"))
        if len(layer.shape) == 2 and (layer.shape[0] % GEMM_TILE or layer.shape[1] % GEMM_TILE):
            findings.append(Finding("info", "tail", layer.fqn, f"[N, K] = {list(layer.shape)} is not a multiple "
                                    f"of {GEMM_TILE}: its GEMM runs masked tail tiles, a little slower"))
    for name in state.upcast:
        findings.append(Finding("info", "upcast", name, "reduction was in bf16/fp16; now in fp32, cast back"))
    for name in state.fused_norms:
        findings.append(Finding("info", "fused_norm", name, "norm and its fp8 quantizers run as one kernel"))
    for name in state.decode_attention:
        findings.append(Finding("info", "decode_attention", name, "decode attention runs fxquant's split-KV kernel"))
    for name in state.rotary_cache:
        findings.append(Finding("info", "rotary_cache", name, "rotary embedding and cache write run as one kernel"))
    for name in state.cache_length:
        findings.append(Finding("info", "cache_length", name, "the cache's length is counted in that kernel"))
    for name, why in state.attention_left:
        findings.append(Finding("info", "attention_left", name, f"decode attention stays on SDPA: {why}"))
    return findings


def _reference_reason(layer) -> str | None:
    """Why a quantized layer's product would run the pure-torch reference on a GPU, from its weight's dtype (the
    activations') and shape; None where kernels serve it, or where the record has no dtype (experts)."""
    if layer.dtype is None:
        return None
    s = RECIPES[layer.recipe]
    return reference_reason(s.kind, s.weight_fmt, s.act_group, weight_group(s), layer.shape[-1], layer.dtype)


def _expert_findings(weights) -> list[Finding]:
    experts = [w for w in weights if w.role == "expert"]
    if not experts:
        return []
    held, total = sum(w.nbytes for w in experts), sum(w.nbytes for w in weights)
    owners = ", ".join(dict.fromkeys(w.used_by for w in experts))
    return [Finding("warning", "experts", owners, f"{len(experts)} {ROLES['expert']} hold {held:,} bytes, "
                    f"{100 * held / total:.0f}% of the model's {total:,} weight bytes, and stay in high precision")]


def _routing_findings(gm: torch.fx.GraphModule) -> list[Finding]:
    """A router with no expert product in its graph: the experts run outside the compiled graphs (transformers'
    eager experts loop, or a loop over per-expert modules, breaks the graph on its data-dependent routing), where
    no pass can quantize them."""
    routers = [node for node in gm.graph.nodes if getattr(annotation(node), "router", False)]
    products = any(getattr(annotation(node), "kind", None) == "experts" or str(node.target).startswith(
        "fxquant.grouped") for node in gm.graph.nodes)
    if not routers or products:
        return []
    return [Finding("warning", "experts", linear_fqn(routers[0]), "its experts run outside the compiled graph "
                    "(the routing breaks it) and stay in high precision. Fix: run the experts as grouped_mm "
                    "(transformers: model.set_experts_implementation('grouped_mm')), or quantize the model with "
                    "fxquant.quantize_ before compiling")]


def _linear_dtype(node):
    found = annotation(node)
    return node_dtype(node) if found is not None and found.kind == "linear" else None


def _weight_findings(node, w) -> list[Finding]:
    return weight_findings(linear_fqn(node), w)


def weight_findings(fqn: str, w) -> list[Finding]:
    """A weight's non-finite values (an error: its outputs would be NaN) or its range past fp16's (a warning)."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        return []
    # one pass, no copy of the weight (quantize_ checks every weight before its first swap): min and max propagate
    # NaN, so both are finite only where every value is; the count runs only for an error
    w = w.detach()
    lo, hi = torch.aminmax(w) if w.numel() else (torch.zeros(()), torch.zeros(()))
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        bad = int(torch.count_nonzero(~torch.isfinite(w)))
        return [Finding("error", "nonfinite_weight", fqn, f"weight holds {bad} inf/NaN value(s): every output "
                        "that reads them is NaN (quantized, the whole scale block is). Fix: repair or reload the "
                        "checkpoint")]
    amax = max(-float(lo), float(hi))
    if w.dtype != torch.float16 and amax > FP16_MAX:
        return [Finding("warning", "fp16_weight", fqn, f"weight |max| {amax:.4g} is past fp16's {FP16_MAX:g}: "
                        "this model becomes inf if cast to fp16. Fix: keep it in bf16/fp32")]
    return []


def _fp8_cast_findings(gm, node, values) -> list[Finding]:
    """A cast to fp8 with no scale, or a constant scale of 1.0: the silent KV-cache-scale bug class."""
    dtype = _cast_dtype(node)
    if dtype not in FP8_DTYPES:
        return []
    source = node.args[0]
    if target_of(source) in SCALE_OPS and len(source.args) > 1:
        scale = source.args[1]
        value = scale
        if isinstance(scale, torch.fx.Node):
            value = values.get(scale) if scale.op == "placeholder" else fetch_attr(gm, scale)
        if _is_one(value):
            return [Finding("warning", "fp8_cast", node.name, f"cast to {dtype} uses a static scale of 1.0: values "
                            "past the format's max saturate and small ones flush to zero. Fix: calibrate the scale "
                            "(amax / format max), or quantize dynamically with fxquant.quantize")]
        return []
    return [Finding("warning", "fp8_cast", node.name, f"cast to {dtype} with no scale (an implicit 1.0): values "
                    "past the format's max saturate and small ones flush to zero. Fix: divide by a scale of amax / "
                    "format max first, or use fxquant.quantize")]


def _is_one(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() > 0 and bool((value == 1).all())
    return isinstance(value, int | float) and value == 1


def _cast_dtype(node):
    target = target_of(node)
    if target in DTYPE_CASTS:
        for arg in (*node.args[1:], node.kwargs.get("dtype")):
            if isinstance(arg, torch.dtype):
                return arg
    return None


def _fp16_activation_findings(gm, example_inputs) -> list[Finding]:
    """fp16 layers whose output on the sample inputs, from finite inputs, is past fp16's max: it would be inf."""
    from fxquant.compile.measure import for_each_linear

    findings = []

    def check(node, x, w, bias, routing):
        if node_dtype(node) != torch.float16:
            return
        finite = lambda rows: rows[torch.isfinite(rows).all(-1)].float()  # poisoned rows propagate, as documented
        # fp32 accumulation, as every fxquant GEMM: only the final cast to fp16 can overflow.
        if routing is None:
            outs = [torch.nn.functional.linear(finite(x.reshape(-1, x.shape[-1])), w.float(),
                                               None if bias is None else bias.float())]
        else:  # each expert's rows by its own weights
            outs = [finite(x[rows]) @ w[e].float().T for e, rows in routing.groups()]
        amax = max((float(out.abs().max()) for out in outs if out.numel()), default=0.0)
        if amax > FP16_MAX:
            findings.append(Finding("error", "fp16_overflow", linear_fqn(node), f"output reaches {amax:.4g} on the "
                                    f"sample inputs, past fp16's {FP16_MAX:g}: it would be inf. Fix: run the model in "
                                    "bf16, or rescale this layer and the next"))

    for_each_linear(gm, example_inputs, check)
    return findings
