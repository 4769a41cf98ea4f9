"""`QuantConfig`: what to quantize and how; named recipes; `from_options` for the backend's options dict."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

INNERS = ("inductor", "eager")
# torch.compile refuses mode= together with options=, so the inner Inductor's mode also travels as an option.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# lm_head feeds a 100k-way softmax and MoE routers pick experts: both stay in high precision by default.
DEFAULT_SKIP = (r"(^|\.)lm_head$", r"(^|\.)router$", r"\.gate$")


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer is quantized.

    kind: "fp8" (fp8 activations and weight, scaled GEMM), "mxfp8" (both MX, reference GEMM) or
          "weight_only" (activations untouched)
    act_group: fp8 activations: 0 per token, -1 per tensor, else 1 x act_group groups
    weight_fmt / weight_granularity: as `fxquant.quantize` takes them
    """

    kind: str
    weight_fmt: str
    weight_granularity: object
    act_group: int = 0
    k_multiple: int = 16  # the weight's K must divide by this (group or block size; 16 for tensor cores)
    n_multiple: int = 16

    def __str__(self) -> str:
        if self.kind == "weight_only":
            return f"{self.weight_fmt} weight-only"
        act = {0: "token", -1: "tensor"}.get(self.act_group, f"1x{self.act_group}")
        return f"{self.kind}: act {act}, weight {self.weight_granularity}"


RECIPES = {
    "fp8_block": LinearScheme("fp8", "fp8_e4m3", ("block", 128, 128), 128, 128, 128),
    "fp8_row": LinearScheme("fp8", "fp8_e4m3", "channel", 0),
    "fp8_tensor": LinearScheme("fp8", "fp8_e4m3", "tensor", -1),
    "mxfp8": LinearScheme("mxfp8", "mxfp8", None, 32, 32),
    "mxfp4_wo": LinearScheme("weight_only", "mxfp4", None, k_multiple=32),
    "nvfp4_wo": LinearScheme("weight_only", "nvfp4", None, k_multiple=16),
    "int8_wo": LinearScheme("weight_only", "int8", "channel"),
    "int4_wo": LinearScheme("weight_only", "int4", ("group", 128), k_multiple=128),
}


@dataclass(frozen=True)
class QuantConfig:
    recipe: str = "fp8_block"
    skip: tuple[str, ...] = ()  # regexes on fully qualified names, added to DEFAULT_SKIP
    include: tuple[str, ...] = ()  # if given, only matching names are quantized
    inner: str = "inductor"
    mode: str | None = None
    report: bool = False
    default_skip: tuple[str, ...] = field(default=DEFAULT_SKIP)

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"fxquant: unknown recipe {self.recipe!r}; valid: {', '.join(RECIPES)}")
        if self.mode not in MODES:
            raise ValueError(f"fxquant: unknown mode {self.mode!r}; valid: {', '.join(map(str, MODES))}")
        if self.inner not in INNERS:
            raise ValueError(f"fxquant: unknown inner {self.inner!r}; valid: {', '.join(INNERS)}")
        for pattern in (*self.skip, *self.include):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"fxquant: skip/include pattern {pattern!r} is not a regex: {exc}") from exc

    @property
    def scheme(self) -> LinearScheme:
        return RECIPES[self.recipe]

    def skip_reason(self, fqn: str | None) -> str | None:
        """Why the layer `fqn` stays unquantized by name, or None."""
        name = fqn or ""
        if self.include and not any(re.search(p, name) for p in self.include):
            return "not in include"
        for pattern in self.skip:
            if re.search(pattern, name):
                return f"skip option {pattern!r}"
        for pattern in self.default_skip:
            if re.search(pattern, name):
                return "default exclusion (lm_head / router)"
        return None


def from_options(options: dict | QuantConfig | None) -> QuantConfig:
    """The backend's `options=` dict (or a QuantConfig) as a QuantConfig, with clear errors."""
    if isinstance(options, QuantConfig):
        return options
    options = dict(options or {})
    valid = [f.name for f in fields(QuantConfig)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"fxquant: unknown option(s) {unknown}; valid options: {', '.join(valid)}")
    for key in ("skip", "include", "default_skip"):
        if key in options:
            value = options[key]
            options[key] = (value,) if isinstance(value, str) else tuple(value)
    return QuantConfig(**options)
