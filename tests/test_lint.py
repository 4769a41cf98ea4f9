"""The numerics lint: refusals name the layer and the fix; warnings come once per compile; the report lists all."""

import warnings

import pytest
import torch
from models import tiny_block

import fxquant
from fxquant.compile.lint import NumericsError

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)


def compile_and_run(model, x, **options):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(model, backend="fxquant", options={"inner": "eager", **options})(x)


def refusal(call) -> str:
    """The NumericsError a compile raised (dynamo wraps backend errors in BackendCompilerFailed)."""
    with pytest.raises(Exception) as caught:  # noqa: B017, PT011  (unwrapped and checked below)
        call()
    error = getattr(caught.value, "inner_exception", caught.value)
    assert isinstance(error, NumericsError), caught.value
    return str(error)


def linear_with_weight(weight, dtype):
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    return torch.nn.Sequential(layer)


def test_fp16_layer_whose_output_overflows_refuses_naming_layer_and_fix():
    model = linear_with_weight(torch.full((256, 256), 3.0), torch.float16)
    x = torch.full((4, 256), 100.0, dtype=torch.float16)  # 100 * 3 * 256 = 76800 > 65504
    message = refusal(lambda: compile_and_run(model, x, recipe="fp8_row"))
    assert "0: output reaches 7.68e+04 on the sample inputs, past fp16's 65504" in message
    assert "Fix: run the model in bf16" in message


def test_fp16_layer_within_range_compiles():
    model = linear_with_weight(torch.full((256, 256), 3.0), torch.float16)
    x = torch.full((4, 256), 80.0, dtype=torch.float16)  # 61440: in range
    assert torch.isfinite(compile_and_run(model, x, recipe="fp8_row")).all()


def test_nonfinite_weight_refuses_in_the_backend_and_in_export():
    weight = torch.randn(256, 256)
    weight[3, 7] = float("inf")
    model = linear_with_weight(weight, torch.bfloat16)
    message = refusal(lambda: compile_and_run(model, X, recipe="int8_wo"))
    assert "0: weight holds 1 inf/NaN" in message and "reload the checkpoint" in message
    with pytest.raises(NumericsError, match="weight holds 1 inf/NaN"):
        fxquant.export(model, (X,), config={"recipe": "fp8_block"})


def test_bf16_weight_past_fp16_max_warns_once():
    weight = torch.randn(256, 256)
    weight[0, 0] = 1e5
    model = linear_with_weight(weight, torch.bfloat16)
    with pytest.warns(UserWarning, match="past fp16's 65504: this model becomes inf if cast to fp16"):
        compile_and_run(model, X, recipe="fp8_row")


class Fp8Cache(torch.nn.Module):
    """A KV-cache-like cast to fp8 with a static scale buffer."""

    def __init__(self, scale):
        super().__init__()
        self.proj = torch.nn.Linear(256, 256)
        self.register_buffer("k_scale", torch.tensor(scale))

    def forward(self, x):
        k = (self.proj(x) / self.k_scale).to(torch.float8_e4m3fn)
        return k.to(x.dtype) * self.k_scale


class BareFp8Cast(torch.nn.Module):
    def forward(self, x):
        return x.to(torch.float8_e4m3fn).to(x.dtype)


@pytest.mark.parametrize(("model", "message"), [
    (Fp8Cache(1.0), "static scale of 1.0"),
    (BareFp8Cast(), "with no scale"),
])
def test_fp8_cast_with_unit_or_no_scale_warns(model, message):
    with pytest.warns(UserWarning, match=message):
        compile_and_run(model.to(torch.bfloat16), X)


def test_fp8_cast_with_a_calibrated_scale_is_quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compile_and_run(Fp8Cache(0.05).to(torch.bfloat16), X)


class Misaligned(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.odd = torch.nn.Linear(100, 256)  # K = 100: no recipe's tensor-core tile divides it
        self.tail = torch.nn.Linear(256, 144)  # N = 144: quantized, masked tail tiles

    def forward(self, x):
        return self.tail(self.odd(x))


def test_misaligned_layer_warns_once_per_compile_and_the_report_lists_every_finding(capsys):
    model = Misaligned().to(torch.bfloat16)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fxquant", options={"inner": "eager", "recipe": "fp8_row", "report": True})
    x = torch.randn(4, 100, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for _ in range(3):
            fn(x)
    lint = [w for w in caught if "numerics lint" in str(w.message)]
    assert len(lint) == 1 and "odd: stays in high precision: alignment" in str(lint[0].message)
    report = capsys.readouterr().out
    assert "info: tail: [N, K] = [144, 256] is not a multiple of 128" in report


# (recipe, activation dtype, K): the reason its product would run the reference on a GPU, or None where kernels take it
SLOW_PATHS = {
    ("mxfp8", torch.float16, 256): "an mxfp8 weight multiplies bf16 activations",
    ("mxfp8", torch.bfloat16, 256): None,
    ("int4_wo", torch.float32, 256): "they multiply bf16 or fp16 activations, not torch.float32",
    ("int4_wo", torch.bfloat16, 256): None,
    ("fp8_row", torch.float32, 256): None,
    ("fp8_row", torch.bfloat16, 16384 + 128): "its activation quantizer: a row lives in registers: 16512 elements",
    ("fp8_block", torch.bfloat16, 16384 + 128): None,  # its quantizer's rows are 128 long
    ("int4_fp8", torch.float32, 256): None,
}


@pytest.mark.parametrize(("recipe", "dtype", "K"), list(SLOW_PATHS), ids=str)
def test_a_layer_whose_product_would_run_the_reference_on_the_gpu_is_reported_naming_why(recipe, dtype, K, capsys):
    """The kernels' own refusals, asked at compile time: a slow path is never silent. On the CPU, where every product
    runs the reference, the report says it; a weight on the GPU makes it a warning."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = linear_with_weight(torch.randn(32, K) * 0.05, dtype).to(device)
    x = torch.randn(2, K, dtype=dtype, device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compile_and_run(model, x, recipe=recipe, report=True)
    report = " ".join(capsys.readouterr().out.split())  # the report's findings wrap at 120 columns
    warned = [str(w.message) for w in caught if "runs the pure-torch reference, on the GPU too" in str(w.message)]
    why = SLOW_PATHS[recipe, dtype, K]
    if why is None:
        assert "runs the pure-torch reference" not in report and warned == []
    else:
        name = str(dtype).removeprefix("torch.")
        severity = "warning" if device == "cuda" else "info"
        assert report.count("runs the pure-torch reference") == 1
        finding = f"{severity}: 0: {recipe} on {name} activations runs the pure-torch reference, on the GPU too: {why}"
        assert finding in report
        assert "run the model in bf16" in report
        assert len(warned) == (device == "cuda")


def test_report_lists_reductions_moved_to_fp32(capsys):
    compile_and_run(tiny_block(), X, report=True)
    assert "reductions moved to fp32:" in capsys.readouterr().out


def test_outlier_that_coarsens_a_per_tensor_scale_warns_and_the_report_shows_it(capsys):
    weight = torch.randn(256, 256) * 0.02
    # One outlier 1e5 times the typical weight sets the per-tensor scale past e4m3's 2^18 dynamic range: the other
    # rows fall to subnormals (worst channel ~17 dB, under the 20 dB floor; the whole tensor still reads ~70 dB).
    weight[7, 3] = 2000.0
    model = linear_with_weight(weight, torch.bfloat16)
    with pytest.warns(UserWarning, match=r"0: an output channel's weight SQNR is .* dB under fp8_tensor.*Fix: fp8_row"):
        compile_and_run(model, X, recipe="fp8_tensor", report=True)
    assert "weight SQNR dB (worst channel)" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # per-channel scales confine the outlier to its own row
        compile_and_run(model, X, recipe="fp8_row")


def test_a_gate_of_one_output_is_reported_not_warned_about(capsys):
    """Qwen2-MoE's shared-expert gate is [1, H]: no recipe tiles it, and it holds no bytes worth a warning."""
    gate = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)).to(torch.bfloat16)
    torch._dynamo.reset()
    fn = torch.compile(gate, backend="fxquant", options={"inner": "eager", "recipe": "fp8_row", "report": True})
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        fn(torch.randn(4, 256, dtype=torch.bfloat16))
    assert not [w for w in caught if "numerics lint" in str(w.message)]
    report = capsys.readouterr().out
    lines = report.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("1 "))
    assert lines[row].split()[2] == "kept" and lines[row + 1].strip().startswith("kept in high precision: alignment")


def test_quantize_in_place_reports_the_slow_path_too(capsys):
    """quantize_ frees the weight it quantized; its record keeps the dtype and device the finding needs."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fxquant.quantize_(linear_with_weight(torch.randn(32, 256) * 0.05, torch.float32).to(device),
                      {"recipe": "int4_wo", "report": True})
    report = " ".join(capsys.readouterr().out.split())
    assert "0: int4_wo on float32 activations runs the pure-torch reference, on the GPU too: they multiply" in report
