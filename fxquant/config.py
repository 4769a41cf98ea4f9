"""`QuantConfig`: what to quantize and how; named recipes; `from_options` for the backend's options dict."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from fxquant.numerics.int4 import SEARCHED
from fxquant.numerics.row_powers_of_two import SCALE_MODE as ROW_POWERS_OF_TWO

INNERS = ("inductor", "eager")
# torch.compile refuses mode= together with options=, so the inner Inductor's mode also travels as an option.
MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# lm_head feeds a 100k-way softmax: it stays in high precision by default; named in layer_recipes, int8_wo keeps its
# top-1 tokens (docs/decisions/0033-lm-head-high-precision-by-default.md). MoE routers, which pick experts, are
# kept by structure (their output feeds a top-k), not by name: see passes/patterns.py.
DEFAULT_SKIP = (r"(^|\.)lm_head$",)


@dataclass(frozen=True)
class LinearScheme:
    """How one linear layer is quantized.

    kind: "fp8" (fp8 activations and weight, scaled GEMM), "mxfp8" (both MX, reference GEMM),
          "int4_fp8" (fp8 activations, int4 weight, on the fp8 tensor cores) or "weight_only" (activations untouched)
    act_group: fp8 activations: 0 per token, -1 per tensor, else 1 x act_group groups
    weight_fmt / weight_granularity: as `fxquant.quantize` takes them
    """

    kind: str
    weight_fmt: str
    weight_granularity: object
    act_group: int = 0
    k_multiple: int = 16  # the weight's K must divide by this (group or block size; 16 for tensor cores)
    n_multiple: int = 16
    symmetric: bool = False  # int4: codes -7..7 with no zero point, rather than 0..15 with one per group
    scale_mode: str | None = None  # how the weight's scales are chosen, as `fxquant.quantize` takes it

    def __str__(self) -> str:
        if self.kind == "weight_only":
            return f"{self.weight_fmt}{' symmetric' if self.symmetric else ''} weight-only"
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
    # int4's group scales searched for each group's least squared error: the MiniLM set kept more than under the amax
    # scales, and the kernels read the same layout (docs/decisions/0042-int4-weight-only-scales-searched.md)
    "int4_wo": LinearScheme("weight_only", "int4", ("group", 128), k_multiple=128, scale_mode=SEARCHED),
    # GPTQ's layout, which vLLM's Marlin kernels serve: no zero points, so 4.25 bits a weight against int4_wo's 4.31.
    "int4_sym_wo": LinearScheme("weight_only", "int4", ("group", 128), k_multiple=128, symmetric=True,
                                scale_mode=SEARCHED),
    # W4A8: symmetric int4 weights (codes -7..7, exact in e4m3) and e4m3 activations per token, on the fp8 tensor
    # cores; symmetric as the W4A8 scheme vLLM loads from compressed-tensors checkpoints.
    # Group scales a power of two times their row's: past 128 rows the fp8 tensor cores multiply the codes
    # row-scaled, and the MiniLM set kept more than under the groups' amax scales (numerics/row_powers_of_two.py).
    "int4_fp8": LinearScheme("int4_fp8", "int4", ("group", 128), 0, k_multiple=128, symmetric=True,
                             scale_mode=ROW_POWERS_OF_TWO),
}
AUTO = "auto"
KEEP = "none"  # in layer_recipes: keep this layer in high precision
# recipe="auto" tries these per layer and keeps the first that meets min_sqnr_db: fewest weight bytes first
# (4.25, 4.5, 4.5 bits), then 8-bit schemes, fp8 GEMMs before int8 weight-only, which reads bf16 activations.
AUTO_LADDER = ("mxfp4_wo", "nvfp4_wo", "int4_wo", "fp8_row", "fp8_block", "fp8_tensor", "int8_wo")


@dataclass(frozen=True)
class QuantConfig:
    recipe: str = "fp8_block"  # a key of RECIPES, or "auto" (measured per layer on sample inputs)
    layer_recipes: tuple[tuple[str, str], ...] = ()  # (regex on fully qualified name, recipe): first match wins
    min_sqnr_db: float = 30.0  # recipe="auto": the output SQNR floor each layer's scheme must meet
    skip: tuple[str, ...] = ()  # regexes on fully qualified names, added to DEFAULT_SKIP
    include: tuple[str, ...] | None = None  # if given, only matching names are quantized: () selects none
    inner: str = "inductor"
    mode: str | None = None
    report: bool = False
    default_skip: tuple[str, ...] = field(default=DEFAULT_SKIP)
    disable_passes: tuple[str, ...] = ()  # fusing or packing passes to leave out (fxquant.compile.pipeline.OPTIONAL)
    # Inductor's own options for the inner compile, as torch.compile(options=...) takes them without fxquant
    # ({"combo_kernels": True}); they come after the ones `mode` sets
    inductor: tuple[tuple[str, object], ...] = ()
    # The layout the backend holds int4 codes in (weight_store.tiles_chosen), and MXFP4's and NVFP4's under
    # fp4_lanes: None, tiles where the GPU's 4-bit kernels read them (CUDA, sm_80+; int4_fp8's rows until its step is
    # timed over tiles) and rows elsewhere; True, tiles wherever the shape tiles, int4_fp8's too; False, rows
    # (docs/decisions/0029-int4-codes-held-in-tiles-on-the-gpu.md)
    int4_code_tiles: bool | None = None
    # MXFP4 and NVFP4 weight-only linears at one activation row take the mma.sync decode kernel
    # (kernels/gemm_fp4_mma.py) over a per-lane copy of their scales (pack_lanes), rather than the in-register GEMM,
    # and their codes are held as int4's are (int4_code_tiles); False keeps the in-register GEMM and rows. The
    # 32-layer step at one sequence: MXFP4 4.747 -> 3.972 ms, NVFP4 5.705 -> 4.348 (H100,
    # docs/decisions/0031-fp4-decode-on-mma-sync.md)
    fp4_lanes: bool = True
    # int4_fp8 (W4A8) linears at one activation row take the int4 mma.sync decode kernel over their e4m3 codes
    # (kernels/gemm_int4_mma.py, the fp16 MMA) and a per-lane copy of their scales (pack_lanes), rather than the W4A8
    # kernel; False keeps the W4A8 kernel. The 32-layer step at one sequence: 3.470 against 4.293 GPU ms (H100,
    # docs/decisions/0043-w4a8-decode-on-the-int4-mma-kernel.md)
    int4_fp8_lanes: bool = True

    def __post_init__(self):
        _check_types(self)
        if self.recipe not in RECIPES and self.recipe != AUTO:
            raise ValueError(f"fxquant: unknown recipe {self.recipe!r}; valid: {', '.join(RECIPES)}, {AUTO}")
        for pattern, recipe in self.layer_recipes:
            if recipe not in RECIPES and recipe != KEEP:
                raise ValueError(f"fxquant: layer_recipes maps {pattern!r} to unknown recipe {recipe!r}; "
                                 f"valid: {', '.join(RECIPES)}, {KEEP}")
        if not isinstance(self.min_sqnr_db, int | float):
            raise ValueError(f"fxquant: min_sqnr_db must be a number of dB, got {self.min_sqnr_db!r}")
        if self.mode not in MODES:
            raise ValueError(f"fxquant: unknown mode {self.mode!r}; valid: {', '.join(map(str, MODES))}")
        if self.inner not in INNERS:
            raise ValueError(f"fxquant: unknown inner {self.inner!r}; valid: {', '.join(INNERS)}")
        for pattern in (*self.skip, *(self.include or ()), *(p for p, _ in self.layer_recipes)):
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"fxquant: skip/include pattern {pattern!r} is not a regex: {exc}") from exc

    def layer_recipe(self, fqn: str | None) -> str | None:
        """The first layer_recipes entry matching `fqn`, or None."""
        return next((recipe for pattern, recipe in self.layer_recipes if re.search(pattern, fqn or "")), None)

    def recipe_for(self, fqn: str | None) -> str:
        """The recipe that quantizes layer `fqn`: its layer_recipes entry, else `recipe`."""
        pinned = self.layer_recipe(fqn)
        if pinned is not None:
            return pinned
        if self.recipe == AUTO:
            raise ValueError(f"fxquant: layer {fqn!r} has no measured recipe; recipe='auto' needs sample inputs "
                             "(torch.compile and fxquant.export pass them; use fxquant.inspect otherwise)")
        return self.recipe

    def skip_reason(self, fqn: str | None) -> str | None:
        """Why the layer `fqn` stays unquantized by name, or None. A layer_recipes entry matching the layer lifts the
        default exclusions (`layer_recipes={"lm_head": "int8_wo"}` quantizes the LM head), not include or skip."""
        name = fqn or ""
        if self.include is not None and not any(re.search(p, name) for p in self.include):
            return "not in include"
        for pattern in self.skip:
            if re.search(pattern, name):
                return f"skip option {pattern!r}"
        if self.layer_recipe(name) not in (None, KEEP):
            return None
        for pattern in self.default_skip:
            if re.search(pattern, name):
                return f"default exclusion {pattern} (default_skip)"
        return None


PATTERNS = ("skip", "include", "default_skip")
NAMES = (*PATTERNS, "disable_passes")  # the options of strings: one string or a list of them


def _check_types(config: QuantConfig) -> None:
    """Each option's type, named with the option and the value given: a wrong type otherwise surfaces later as an
    error about iteration or dict updates that names neither."""
    def refuse(name, expected):
        raise TypeError(f"fxquant: option {name!r} must be {expected}, got {getattr(config, name)!r} "
                        f"({type(getattr(config, name)).__name__})")

    for name in ("recipe", "inner"):
        if not isinstance(getattr(config, name), str):
            refuse(name, "a string")
    for name in NAMES:
        value = getattr(config, name)
        if value is None and name == "include":
            continue
        if not isinstance(value, tuple) or not all(isinstance(p, str) for p in value):
            refuse(name, "a regex string or a list of them" if name in PATTERNS else "a pass's name or a list of them")
    if not isinstance(config.layer_recipes, tuple) or not all(
            isinstance(entry, tuple) and len(entry) == 2 and all(isinstance(e, str) for e in entry)
            for entry in config.layer_recipes):
        refuse("layer_recipes", "a dict {regex: recipe}")
    if not isinstance(config.inductor, tuple) or not all(
            isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) for entry in config.inductor):
        refuse("inductor", "a dict {Inductor option: value}")
    if config.inductor:
        from torch._inductor import list_options

        unknown = sorted(set(name for name, _ in config.inductor) - set(list_options()))
        if unknown:
            raise ValueError(f"fxquant: option 'inductor' names {unknown}, which Inductor does not have; its "
                             f"options are torch._inductor.config's (torch._inductor.list_options())")
    if not isinstance(config.report, bool):
        refuse("report", "True or False")
    if config.int4_code_tiles is not None and not isinstance(config.int4_code_tiles, bool):
        refuse("int4_code_tiles", "True, False or None")
    if not isinstance(config.fp4_lanes, bool):
        refuse("fp4_lanes", "True or False")
    if not isinstance(config.int4_fp8_lanes, bool):
        refuse("int4_fp8_lanes", "True or False")
    if isinstance(config.min_sqnr_db, bool) or not isinstance(config.min_sqnr_db, int | float):
        refuse("min_sqnr_db", "a number of dB")


def from_options(options: dict | QuantConfig | str | None) -> QuantConfig:
    """The backend's `options=` dict (or a QuantConfig, or a recipe's name alone) as a QuantConfig, with clear
    errors naming the option and the type it takes."""
    if isinstance(options, QuantConfig):
        return options
    if isinstance(options, str):
        options = {"recipe": options}
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"fxquant: options must be a dict such as {{'recipe': 'fp8_row'}}, a recipe's name or a "
                        f"QuantConfig, got {options!r} ({type(options).__name__})")
    options = dict(options or {})
    valid = [f.name for f in fields(QuantConfig)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"fxquant: unknown option(s) {unknown}; valid options: {', '.join(valid)}")
    for key in NAMES:
        value = options.get(key)
        if isinstance(value, str):
            options[key] = (value,)
        elif isinstance(value, list | tuple | set | frozenset):  # other types are refused by name in QuantConfig
            options[key] = tuple(value)
    if isinstance(options.get("inductor"), dict):
        options["inductor"] = tuple(options["inductor"].items())
    if isinstance(options.get("layer_recipes"), dict):
        options["layer_recipes"] = tuple(options["layer_recipes"].items())
    elif isinstance(options.get("layer_recipes"), list):  # [(regex, recipe), ...]; anything else is refused
        options["layer_recipes"] = tuple(tuple(e) if isinstance(e, list | tuple) else e
                                         for e in options["layer_recipes"])
    return QuantConfig(**options)
