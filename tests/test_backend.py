"""End to end: torch.compile(backend="fxquant") on small models, every recipe, shapes, options, weights."""

import subprocess
import sys
import warnings

import pytest
import torch
from models import rel_err, residual_norm_mlp, tiny_block
from reports import layer_rows

import fxquant
from fxquant.config import RECIPES
from fxquant.kernels.dependent_launch import dependent_launches

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)
# Output error bound against eager bf16, per recipe: fp8 ~2^-4 per element averages down; 4-bit formats
# carry ~2^-3 relative weight error.
BOUNDS = {"fp8_block": 0.03, "fp8_row": 0.03, "fp8_tensor": 0.03, "mxfp8": 0.04, "int8_wo": 0.01,
          "int4_wo": 0.05, "int4_sym_wo": 0.05, "int4_fp8": 0.06, "mxfp4_wo": 0.06, "nvfp4_wo": 0.06}


def compiled(model, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="fxquant", fullgraph=True, options={"inner": "eager", **options})


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_every_recipe_stays_close_to_eager(recipe):
    model = tiny_block()
    with torch.no_grad():
        assert rel_err(compiled(model, recipe=recipe)(X), model(X)) < BOUNDS[recipe]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_and_fp16_models_keep_their_dtype(dtype):
    model = tiny_block(dtype)
    x = X.to(dtype)
    with torch.no_grad():
        out = compiled(model)(x)
    assert out.dtype == dtype and rel_err(out, model(x)) < 0.03


@pytest.mark.cpu_only
def test_inductor_lowering():
    model = tiny_block()
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="fxquant", options={"recipe": "fp8_row"})(X)
    assert rel_err(out, model(X)) < 0.03


def test_one_compile_serves_every_m():
    """Dynamo itself specializes dims of size 0 and 1 (decode's seq = 1 gets its own graph); every other
    batch and sequence length shares one graph: nothing fxquant adds makes a guard."""
    model = tiny_block()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    fn = torch.compile(model, backend="fxquant", dynamic=True, options={"inner": "eager"})
    with torch.no_grad():
        for batch, seq in [(2, 8), (3, 5), (2, 64), (7, 2), (16, 3)]:
            x = torch.randn(batch, seq, 256, dtype=torch.bfloat16)
            assert rel_err(fn(x), model(x)) < 0.03
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_report_prints_once_per_compile(capsys):
    fn = compiled(tiny_block(), report=True)
    with torch.no_grad():
        fn(X)
        fn(X)
    out = capsys.readouterr().out
    assert out.count("fxquant report") == 1
    assert "kept in high precision: default exclusion" in layer_rows(out)["lm_head"] and "bytes" in out


@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.cpu_only)])
def test_weight_changed_after_compile_is_requantized_with_one_warning(inner):
    model = tiny_block()
    fn = compiled(model, recipe="fp8_row", inner=inner)
    with torch.no_grad():
        fn(X)
        model.up.weight.mul_(2.0)
        model.down.weight.mul_(-1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = fn(X)
            fn(X)
    assert len([w for w in caught if "re-quantizing" in str(w.message)]) == 1
    with torch.no_grad():
        assert rel_err(out, model(X)) < 0.03


@pytest.mark.parametrize("options, match", [
    ({"recipe": "fp7"}, "unknown recipe 'fp7'; valid: fp8_block"),
    ({"recpie": "fp8_row"}, r"unknown option\(s\) \['recpie'\]; valid options"),
    ({"inner": "tvm"}, "unknown inner 'tvm'"),
    ({"mode": "fast"}, "unknown mode 'fast'"),
    ({"skip": ["("]}, "is not a regex"),
    ({"inductor": {"combo_kernel": True}}, r"option 'inductor' names \['combo_kernel'\], which Inductor does not have"),
])
def test_malformed_options_are_clear_errors(options, match):
    with pytest.raises(Exception, match=match):
        compiled(tiny_block(), **options)(X)


@pytest.mark.parametrize("options, match", [
    ({"skip": 5}, r"option 'skip' must be a regex string or a list of them, got 5 \(int\)"),
    ({"include": 5}, r"option 'include' must be a regex string or a list of them, got 5 \(int\)"),
    ({"layer_recipes": ["a"]}, r"option 'layer_recipes' must be a dict \{regex: recipe\}, got \('a',\)"),
    ({"report": "yes"}, r"option 'report' must be True or False, got 'yes' \(str\)"),
    ({"int4_code_tiles": 1}, r"option 'int4_code_tiles' must be True, False or None, got 1 \(int\)"),
    ({"fp4_lanes": None}, r"option 'fp4_lanes' must be True or False, got None \(NoneType\)"),
    ({"recipe": 8}, r"option 'recipe' must be a string, got 8 \(int\)"),
    ({"min_sqnr_db": "30"}, r"option 'min_sqnr_db' must be a number of dB"),
    ({"inductor": ["combo_kernels"]}, r"option 'inductor' must be a dict \{Inductor option: value\}"),
    (["fp8_row"], r"options must be a dict such as \{'recipe': 'fp8_row'\}.*got \['fp8_row'\] \(list\)"),
])
def test_options_of_the_wrong_type_are_named_with_the_type_they_take(options, match):
    """A wrong type surfaced as "'int' object is not iterable" or a dict-update error naming no option."""
    with pytest.raises(TypeError, match=match):
        fxquant.from_options(options)


@pytest.mark.cpu_only
def test_inductor_options_reach_the_inner_compile_after_the_modes(monkeypatch):
    """options={"inductor": {...}}: Inductor's own options, as torch.compile(options=...) would pass them without
    fxquant, reach compile_fx beside (and after) the ones the mode sets."""
    import torch._inductor.compile_fx as inductor
    from torch._inductor import config as inductor_config

    seen, compile_fx = [], inductor.compile_fx

    def recording(gm, inputs, config_patches=None, **kwargs):  # compile_fx calls itself again inside the patch
        seen.append((dict(config_patches or {}), inductor_config.combo_kernels, inductor_config.triton.cudagraphs))
        return compile_fx(gm, inputs, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(inductor, "compile_fx", recording)  # the function, not a config module
    model = tiny_block()
    options = {"recipe": "fp8_row", "mode": "reduce-overhead",
               "inductor": {"triton.cudagraphs": False, "combo_kernels": True}}
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="fxquant", options=options)(X)
        first = len(seen)
        torch._dynamo.reset()
        with dependent_launches(False):  # Inductor's kernels launched dependent as fxquant's are, or not
            torch.compile(model, backend="fxquant", options={"recipe": "fp8_row"})(X)
    torch._dynamo.reset()
    # the mode's, then fxquant's dependent launch, then the option's
    assert seen[0][0] == {"triton.cudagraphs": False, "triton.enable_pdl": True, "combo_kernels": True}
    assert seen[first - 1][1:] == (True, False)  # in force where Inductor compiles
    assert seen[first][0] == {"triton.enable_pdl": False}
    assert rel_err(out, model(X)) < 0.03
    assert fxquant.from_options(options).inductor == (("triton.cudagraphs", False), ("combo_kernels", True))


def test_a_recipe_name_alone_is_the_options_and_include_none_or_empty_is_said():
    """options="fp8_row" and quantize_(model, "int4_wo") take the name as the recipe; include=None is the default
    (every layer), include=[] selects none."""
    assert fxquant.from_options("fp8_row") == fxquant.QuantConfig(recipe="fp8_row")
    assert fxquant.from_options({"include": None}).skip_reason("model.layers.0.mlp.up_proj") is None
    assert fxquant.from_options({"include": []}).skip_reason("model.layers.0.mlp.up_proj") == "not in include"
    model = fxquant.quantize_(tiny_block(), "int4_wo")
    assert any(isinstance(m, fxquant.QuantizedLinear) and m.recipe == "int4_wo" for m in model.modules())


def test_model_without_linear_layers_compiles_unchanged():
    model = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.GELU()).to(torch.bfloat16)
    with torch.no_grad():
        assert rel_err(compiled(model)(X), model(X)) < 0.01


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "fxquant" for ep in entry_points(group="torch_dynamo_backends"))


@pytest.mark.skipif(not _entry_point_installed(), reason="needs `pip install` (the torch_dynamo_backends entry point)")
def test_backend_by_name_in_a_process_that_never_imports_fxquant():
    code = (
        "import torch\n"
        "m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()).to(torch.bfloat16)\n"
        "x = torch.randn(4, 256, dtype=torch.bfloat16)\n"
        "with torch.no_grad():\n"
        "    out = torch.compile(m, backend='fxquant', options={'inner': 'eager'})(x)\n"
        "    err = ((out.float() - m(x).float()).norm() / m(x).float().norm()).item()\n"
        "import sys; assert 'fxquant' in sys.modules and err < 0.05, err\n"
        "print('ok', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_quantize_api_is_exported():
    assert set(fxquant.__all__) >= {"quantize", "dequantize", "export", "QuantConfig", "backend"}


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_an_input_that_requires_grad_is_refused_with_the_fix(inner):
    x = X.clone().requires_grad_()
    with pytest.raises(Exception, match=r"require grad\. Fix: run the model under torch.no_grad\(\)"):
        compiled(tiny_block(), inner=inner)(x)


class AppliedTwice(torch.nn.Module):
    """One square linear applied to its own output, then one residual MLP block applied twice (ALBERT's shared
    layers, a loop over one block): each weight is read by two applications."""

    def __init__(self):
        super().__init__()
        self.square = torch.nn.Linear(256, 256)
        self.block = residual_norm_mlp()

    def forward(self, x):
        h = self.square(self.square(x))
        return self.block(self.block(h, x), x)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_a_layer_applied_to_its_own_output_compiles_and_stays_close(recipe):
    """The second application's input was the first application's node, which quantize_linear had already
    replaced and erased: compile failed for every recipe."""
    torch.manual_seed(0)
    model = AppliedTwice().to(torch.bfloat16).eval()
    with torch.no_grad():
        assert rel_err(compiled(model, recipe=recipe)(X), model(X)) < 2 * BOUNDS[recipe]  # two quantized passes


def test_grad_mode_with_inputs_that_need_no_grad_runs():
    model = tiny_block()  # its parameters require grad; the compiled graph holds them frozen
    out = compiled(model)(X)
    assert not out.requires_grad and rel_err(out, model(X)) < 0.03


def test_lowered_graph_keeps_dynamo_meta_so_cuda_graphs_take_weights_as_static():
    """AOT counts a graph's constants as static inputs only for a graph it knows came from dynamo (its compile id in
    meta); the lowered copy lost it, and under reduce-overhead every quantized weight was copied on each replay."""
    from fxquant.compile.backend import _without_frozen_parameters

    seen = {}

    def capture(gm, inputs):
        lowered, _ = _without_frozen_parameters(gm, inputs)
        seen["ids"] = gm.meta.get("dynamo_compile_id"), lowered.meta.get("dynamo_compile_id")
        return gm.forward

    torch._dynamo.reset()
    torch.compile(torch.nn.Linear(16, 16), backend=capture)(torch.randn(2, 16))
    assert seen["ids"][0] is not None and seen["ids"][1] == seen["ids"][0]


@pytest.mark.cpu_only
def test_inputs_written_in_place_that_dynamo_marked_static_stay_static_for_cuda_graphs(monkeypatch):
    """A StaticCache's tensors are marked static and written in place. AOT lost those marks for the lowered graph,
    so CUDA graphs skipped every decode step ("mutated inputs"), for every recipe: the run fell back to launching
    each kernel from Python. Every input the graph writes must be among the static inputs Inductor sees."""
    import torch._inductor.compile_fx as inductor

    seen, compile_fx = [], inductor.compile_fx

    def spy_inner(gm, example_inputs, **kwargs):
        meta = torch._guards.TracingContext.try_get().fw_metadata
        written = {i for i, info in enumerate(meta.input_info) if info.mutates_data}
        seen.append((written, set(kwargs["static_input_idxs"])))
        return inductor.compile_fx_inner(gm, example_inputs, **kwargs)

    # compile_fx calls itself again inside its config patches, passing the inner compile on
    monkeypatch.setattr(inductor, "compile_fx", lambda *a, **k: compile_fx(*a, **{"inner_compile": spy_inner, **k}))
    layer = torch.nn.Linear(256, 256).to(torch.bfloat16)
    cache = torch.zeros(4, 256, dtype=torch.bfloat16)
    torch._dynamo.mark_static_address(cache)

    def step(x, position):
        y = layer(x)
        cache.index_copy_(0, position, y)
        return y

    torch._dynamo.reset()
    run = torch.compile(step, backend="fxquant", options={"recipe": "fp8_row"})
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    # The config's own patch: a cache hit would skip the spy, and undoing a monkeypatch of torch's config broke it
    # for every later test in the worker.
    with torch.no_grad(), torch._functorch.config.patch(enable_autograd_cache=False):
        out = run(x, torch.tensor([2]))
    mutated, static = seen[-1]
    assert mutated and mutated <= static, (mutated, static)
    assert torch.equal(cache[2], out[0]) and not cache[[0, 1, 3]].any()


def test_a_graph_dynamo_reuses_for_another_module_runs_with_that_modules_weights():
    """Dynamo takes parameters as graph inputs and reused one graph for every nn.Linear of the same shape, which ran
    with the first module's frozen, quantized weights: silently wrong outputs (cosine -0.02). Each module's
    parameters now get their own compiled variant, with one warning."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256).to(torch.bfloat16) for _ in range(3)]
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    run = torch.compile(lambda layer, x: layer(x), backend="fxquant", options={"recipe": "int8_wo", "inner": "eager"})
    with torch.no_grad(), pytest.warns(UserWarning, match="reuses this compiled graph for another module"):
        outs = [run(layer, x) for layer in layers] + [run(layers[0], x)]
    for layer, out in zip([*layers, layers[0]], outs, strict=True):
        assert rel_err(out, layer(x)) < 0.01  # int8 per channel
