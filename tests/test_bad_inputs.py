"""The bad-input matrix: each cell a clear error naming the layer and the fix, or a documented, tested result.

Cells tested in other files:
- weights mutated after compile: test_backend.py::test_weight_changed_after_compile_is_requantized_with_one_warning
- malformed options: test_backend.py::test_malformed_options_are_clear_errors
- export, then load in a fresh process: test_export.py
- non-finite weights and fp16 overflow on sample inputs: test_lint.py
"""

import warnings

import pytest
import torch
import torch.nn as nn
from models import rel_err

import fxquant
import fxquant.compile.capability
import fxquant.ops
from fxquant.config import RECIPES
from fxquant.numerics import reference as R

ROW_INDEPENDENT = [r for r in RECIPES if r != "fp8_tensor"]  # every recipe whose scales never span rows


def bound(recipe):
    """Output error against eager of two chained random layers: 4-bit weights keep ~20 dB each (0.1), 8-bit ~29 dB
    (0.035)."""
    return 0.25 if RECIPES[recipe].weight_fmt in ("int4", "mxfp4", "nvfp4") else 0.08


class Mlp(nn.Module):
    def __init__(self, d=256, hidden=512, bias=True):
        super().__init__()
        self.up = nn.Linear(d, hidden, bias=bias)
        self.down = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):  # x: [..., D]
        return self.down(torch.nn.functional.gelu(self.up(x)))


def mlp(dtype=torch.bfloat16, **kwargs):
    torch.manual_seed(0)
    return Mlp(**kwargs).to(dtype).eval()


def run(model, x, **options):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="fxquant", options={"inner": "eager", **options})(x)


POISONS = [(float("nan"), torch.bfloat16), (float("-inf"), torch.bfloat16), (float("nan"), torch.float16),
           (float("inf"), torch.float16), (7e4, torch.float16)]  # 7e4: an fp16 activation past 65504 is inf


@pytest.mark.parametrize(("poison", "dtype"), POISONS)
@pytest.mark.parametrize("recipe", ROW_INDEPENDENT)
def test_nonfinite_activation_poisons_its_row_only(recipe, poison, dtype):
    model = mlp(dtype)
    clean = torch.randn(4, 256).to(dtype)
    poisoned = clean.clone()
    poisoned[1, 5] = poison
    out_clean, out = run(model, clean, recipe=recipe), run(model, poisoned, recipe=recipe)
    assert not torch.isfinite(out[1]).any()  # poison is never laundered into finite numbers
    keep = [0, 2, 3]
    assert torch.equal(out[keep], out_clean[keep])  # and other rows are untouched, bit for bit


def test_per_tensor_scale_spreads_poison_to_the_whole_tensor():
    """fp8_tensor's one activation scale is the block: documented, every output is NaN."""
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    assert torch.isnan(run(mlp(), x, recipe="fp8_tensor")).all()


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_zero_rows_and_blocks_give_zeros_never_nan(recipe):
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    x[0] = 0  # an MoE padding row
    x[2, :128] = 0  # one whole 1x128 group
    out = run(mlp(bias=False), x, recipe=recipe)
    assert torch.isfinite(out).all() and torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(run(mlp(bias=False), torch.zeros(3, 256, dtype=torch.bfloat16), recipe=recipe),
                       torch.zeros(3, 256, dtype=torch.bfloat16))


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_row", "fp8_tensor", "int4_wo", "nvfp4_wo"])
@pytest.mark.parametrize("layout", ["strided", "transposed", "sliced"])
def test_non_contiguous_inputs_match_contiguous(recipe, layout):
    base = torch.randn(6, 512, dtype=torch.bfloat16)
    x = {"strided": base[:, ::2], "transposed": base[:, :256].t().contiguous().t(), "sliced": base[1:5, 128:384]}[
        layout]
    assert not x.is_contiguous() or layout == "sliced"
    assert torch.equal(run(mlp(), x, recipe=recipe), run(mlp(), x.contiguous(), recipe=recipe))


class OffBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.k144 = nn.Linear(144, 256)  # K % 16 == 0 but K % 32, K % 128 != 0
        self.n80 = nn.Linear(256, 80)  # N % 16 == 0 but N % 128 != 0

    def forward(self, x):
        return self.n80(self.k144(x))


# Which layers each recipe quantizes (the rest stay in high precision, with the reason in the report).
OFF_BLOCK = {"fp8_block": set(), "fp8_row": {"k144", "n80"}, "fp8_tensor": {"k144", "n80"}, "mxfp8": {"n80"},
             "mxfp4_wo": {"n80"}, "nvfp4_wo": {"k144", "n80"}, "int8_wo": {"k144", "n80"}, "int4_wo": {"n80"},
             "int4_sym_wo": {"n80"}, "int4_fp8": {"n80"}}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_k_and_n_off_the_block_take_tails_or_stay_high_precision(recipe):
    torch.manual_seed(0)
    model = OffBlock().to(torch.bfloat16)
    x = torch.randn(5, 144, dtype=torch.bfloat16)
    report = fxquant.inspect(model, (x,), {"recipe": recipe})
    assert {m.fqn for m in report.layers if m.recipe} == OFF_BLOCK[recipe]
    assert all("alignment" in m.reason for m in report.layers if not m.recipe)
    kept = {"k144", "n80"} - OFF_BLOCK[recipe]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run(model, x, recipe=recipe)
    lint = [str(w.message) for w in caught if "numerics lint" in str(w.message)]
    assert len(lint) == bool(kept)  # one warning per compile, listing every kept layer
    assert all(f"{name}: stays in high precision: alignment" in "".join(lint) for name in kept)
    assert rel_err(out, model(x)) < bound(recipe)


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("m", [0, 1])
def test_m_zero_and_one(recipe, m):
    model = mlp()
    x = torch.randn(m, 256, dtype=torch.bfloat16)
    out = run(model, x, recipe=recipe)
    assert out.shape == (m, 256) and torch.isfinite(out).all()
    if m:
        assert rel_err(out, model(x)) < bound(recipe)


def test_model_without_linear_layers_runs_unchanged(capsys):
    model = nn.Sequential(nn.LayerNorm(64), nn.Softmax(-1)).eval()
    x = torch.randn(3, 64)
    out = run(model, x, report=True)
    assert torch.equal(out, model(x))
    report = capsys.readouterr().out
    assert "weights: quantized 0 of 512 bytes (0%)" in report and "norm weights and biases 512" in report


@pytest.fixture
def pre_ada_gpu(monkeypatch):
    """The graph computes on cuda:0 of compute capability 8.0 (an A100): no fp8 tensor cores."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(fxquant.compile.capability.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr("fxquant.compile.pipeline.graph_device", lambda gm, inputs=(): cuda)
    monkeypatch.setattr("fxquant.compile.inspection.graph_device", lambda gm, inputs=(): cuda)


def test_no_fp8_gpu_refuses_fp8_recipes_with_the_fix(pre_ada_gpu):
    with pytest.raises(Exception) as caught:  # noqa: B017, PT011  (dynamo wraps it; checked below)
        run(mlp(), torch.randn(2, 256, dtype=torch.bfloat16), recipe="fp8_block")
    message = str(getattr(caught.value, "inner_exception", caught.value))
    assert "['fp8_block'] run fp8 GEMMs, which need compute capability 8.9+" in message
    assert "cuda:0 is 8.0" in message and "Fix: use a weight-only recipe" in message


def test_no_fp8_gpu_runs_weight_only_and_auto_avoids_fp8(pre_ada_gpu):
    model, x = mlp(), torch.randn(2, 256, dtype=torch.bfloat16)
    assert rel_err(run(model, x, recipe="int8_wo"), model(x)) < 0.01
    chosen = {m.recipe for m in fxquant.inspect(model, (x,), {"recipe": "auto", "min_sqnr_db": 25}).layers}
    assert chosen and all(RECIPES[r].kind != "fp8" for r in chosen if r)


def test_large_m_never_dequantizes_a_whole_weight_or_activation(monkeypatch):
    """Reference GEMMs work in CHUNK_ROWS tiles: no fp32 copy of a whole weight or activation, at any M."""
    chunk = fxquant.ops.CHUNK_ROWS
    m, n, k = 2 * chunk + 3, chunk + 16, 256
    shapes = []
    dequantize = R.dequantize

    def recording(q, dtype=None):
        out = dequantize(q, dtype)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(R, "dequantize", recording)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k)
    qw = fxquant.quantize(w, "int4", ("group", 128))
    out = fxquant.ops.linear_weight_only(x, qw.data, qw.scale, None, qw.zero_point, None, "int4", 128, n)
    a, a_scale = fxquant.ops.quantize_fp8(x, 128)
    wq = fxquant.quantize(w[:chunk], "fp8_e4m3", ("block", 128, 128))
    fp8_out = fxquant.ops.scaled_mm_fp8(a, a_scale, wq.data, wq.scale, None, torch.bfloat16)
    assert shapes and max(rows for rows, _ in shapes) <= chunk
    monkeypatch.setattr(R, "dequantize", dequantize)
    exact = x.double() @ R.dequantize(qw, torch.float64).T
    assert rel_err(out, exact) < 1e-2 and fp8_out.shape == (m, chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["fp8_block", "int4_wo"])
def test_large_m_on_the_gpu_makes_no_fp32_copies(recipe):
    """At M = 16384 the extra device memory is the fp8 codes and scales (fp8 recipes, whose large-M GEMM is cuBLAS's)
    or the weight dequantized to bf16 (weight-only, likewise), and the output: no fp32 copy of the activation or
    weight."""
    m, k, n = 16384, 4096, 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda") * 0.02
    if recipe == "fp8_block":
        q = fxquant.quantize(w, "fp8_e4m3", ("block", 128, 128))
        call = lambda: fxquant.ops.linear_fp8(x, q.data, q.scale, None, 128)
        # codes, scales, their M-major copy for cuBLAS (`cublas_fp8.py`), bf16 output
        expected = m * k + 2 * m * (k // 128) * 4 + m * n * 2
    else:
        q = fxquant.quantize(w, "int4", ("group", 128))
        call = lambda: fxquant.ops.linear_weight_only(x, q.data, q.scale, None, q.zero_point, None, "int4", 128, n)
        expected = n * k * 2 + m * n * 2  # bf16 weight (one chunk: n * k <= CHUNK_ELEMENTS), bf16 output
    call()  # compile and warm up outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    assert out.shape == (m, n)
    assert torch.cuda.max_memory_allocated() - base <= expected + 2**20  # 1 MiB for split-K partials and the like
