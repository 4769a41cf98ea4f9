"""Each pass on a tiny dynamo-captured graph: node counts, honest `modified`, untouched nodes, numbers."""

import operator

import pytest
import torch
import torch.nn.functional as F
from hf_models import dynamo_graph
from models import rel_err, tiny_block
from reports import section

import fxquant
from fxquant.config import RECIPES, QuantConfig
from fxquant.passes.annotations import annotation
from fxquant.passes.cleanup import Cleanup
from fxquant.passes.detect import Detect
from fxquant.passes.freeze_params import FreezeParams
from fxquant.passes.fuse_linear import FuseLinear
from fxquant.passes.quantize_linear import QuantizeLinear
from fxquant.passes.state import PipelineState
from fxquant.passes.upcast import Upcast

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)


def capture(model, x=X):
    """The graph and example inputs dynamo hands a backend."""
    return dynamo_graph(model, x)


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.target is target or (n.op == "call_method" and n.target == target))


def frozen(model):
    gm, inputs = capture(model)
    FreezeParams(inputs)(gm)
    return gm, inputs


def test_freeze_params_turns_parameters_into_constants():
    gm, inputs = capture(tiny_block())
    result = FreezeParams(inputs)(gm)
    assert result.modified
    names = {n.meta.get("fxquant_fqn") for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"q.weight", "up.weight", "down.weight", "lm_head.weight", "norm.weight"} <= names
    assert all(not n.users for n in gm.graph.nodes if n.op == "placeholder" and n.name != "l_x_")
    assert not FreezeParams(inputs)(gm).modified


def test_detect_finds_every_kind_and_changes_no_code():
    gm, _ = frozen(tiny_block())
    code = gm.code
    result = Detect()(gm)
    kinds = sorted(a.kind for n in gm.graph.nodes if (a := annotation(n)))
    assert kinds == ["layer_norm", "linear", "linear", "linear", "linear", "rms_norm", "rms_norm_variance",
                     "softmax"]
    assert {a.fqn for n in gm.graph.nodes if (a := annotation(n)) and a.kind == "linear"} == {
        "q", "up", "down", "lm_head"}
    assert not result.modified and gm.code == code


def test_detect_aten_spellings():
    model = tiny_block()
    gm = torch.export.export(model, (X,)).module()
    FreezeParams(None)(gm)
    Detect()(gm)
    kinds = sorted(a.kind for n in gm.graph.nodes if (a := annotation(n)))
    assert kinds.count("linear") == 4 and "softmax" in kinds and "layer_norm" in kinds


def test_upcast_runs_reductions_in_fp32_and_keeps_dtypes():
    model = tiny_block()
    gm, inputs = frozen(model)
    Detect()(gm)
    result = Upcast(PipelineState(QuantConfig()))(gm)
    assert result.modified
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert sum(1 for c in casts if c.kwargs["dtype"] == torch.float32) >= 4  # softmax, 3 norms
    assert not Upcast(PipelineState(QuantConfig()))(gm).modified
    out = gm(*inputs)[0]
    assert out.dtype == torch.bfloat16
    assert rel_err(out, model(X)) < 0.02


def test_upcast_reaches_a_softmax_given_a_low_precision_dtype():
    """softmax(x, dim=-1, dtype=bf16) casts its input to bf16 before the reduction: the upcast gives it dtype=fp32
    too, so it reduces in fp32 (its output, cast back to bf16, is the fp32 softmax's rounding). The CPU's bf16
    softmax reduces in fp32 inside, so the kwarg is what tells the two apart here."""

    class Softmax(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.softmax(x, dim=-1, dtype=torch.bfloat16)

    x = torch.randn(4, 4096, dtype=torch.bfloat16) * 4
    gm = torch.fx.symbolic_trace(Softmax())
    for node in gm.graph.nodes:
        node.meta["val"] = x if node.op == "placeholder" else None
    Detect()(gm)
    assert Upcast(PipelineState(QuantConfig()))(gm).modified
    softmax = next(n for n in gm.graph.nodes if n.op == "call_function" and "softmax" in str(n.target))
    assert softmax.kwargs["dtype"] == torch.float32
    torch.testing.assert_close(gm(x), torch.softmax(x.float(), -1).bfloat16(), rtol=0, atol=0)


def test_quantize_then_fuse_counts_and_numbers():
    model = tiny_block()
    gm, inputs = frozen(model)
    Detect()(gm)
    state = PipelineState(QuantConfig(recipe="fp8_block"))
    assert QuantizeLinear(state)(gm).modified
    assert count(gm, torch.ops.fxquant.quantize_fp8.default) == 3  # lm_head skipped by default
    assert count(gm, torch.ops.fxquant.scaled_mm_fp8.default) == 3
    assert count(gm, torch._C._nn.linear) == 1  # lm_head untouched
    assert [layer.fqn for layer in state.layers if layer.recipe is None] == ["lm_head"]
    assert not QuantizeLinear(PipelineState(QuantConfig(recipe="fp8_block")))(gm).modified
    assert FuseLinear()(gm).modified
    assert count(gm, torch.ops.fxquant.linear_fp8.default) == 3
    assert count(gm, torch.ops.fxquant.quantize_fp8.default) == 0 and count(gm, operator.getitem) == 0
    assert not FuseLinear()(gm).modified
    Cleanup()(gm)
    assert rel_err(gm(*inputs)[0], model(X)) < 0.05


def test_skip_and_alignment_leave_layers_in_high_precision():
    gm, _ = frozen(tiny_block())
    Detect()(gm)
    state = PipelineState(QuantConfig(recipe="int4_wo", skip=(r"^up$",)))
    QuantizeLinear(state)(gm)
    reasons = {layer.fqn: layer.reason for layer in state.layers}
    assert reasons["up"].startswith("skip option") and reasons["lm_head"].startswith("default exclusion")
    assert reasons["q"] == "" and reasons["down"] == ""
    assert count(gm, torch.ops.fxquant.linear_weight_only.default) == 2


def test_unaligned_layer_is_skipped_with_a_reason():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(200, 64)

        def forward(self, x):
            return F.relu(self.fc(x))

    gm, inputs = capture(Odd().to(torch.bfloat16), torch.randn(4, 200, dtype=torch.bfloat16))
    FreezeParams(inputs)(gm)
    Detect()(gm)
    state = PipelineState(QuantConfig(recipe="fp8_block"))
    assert not QuantizeLinear(state)(gm).modified
    assert "alignment" in state.layers[0].reason


class VarianceReadTwice(torch.nn.Module):
    """pow -> mean feeds rsqrt and something else: no RMSNorm pattern, so nothing may be half upcast."""

    def forward(self, x):  # x: [B, D] bf16
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + 1e-6) + (variance + 1)


def test_upcast_leaves_a_partial_variance_pattern_whole():
    model = VarianceReadTwice()
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    gm, inputs = capture(model, x)
    FreezeParams(inputs)(gm)
    Detect()(gm)
    assert not any(annotation(n) for n in gm.graph.nodes)
    assert not Upcast(PipelineState(QuantConfig()))(gm).modified
    out = gm(*inputs)[0]
    assert out.dtype == torch.bfloat16 and torch.equal(out, model(x))


def test_report_names_reductions_by_module_path(capsys):
    model = torch.nn.Sequential(tiny_block())
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="fxquant", options={"inner": "eager", "report": True})(X)
    names = section(capsys.readouterr().out, "reductions moved to fp32: ").split(", ")
    assert {"0.norm (rms_norm)", "0.hand_norm (rms_norm_variance)", "0.ln (layer_norm)", "0 (softmax)"} == set(names)


class ParameterProducts(torch.nn.Module):
    """Weights stored [K, N] and multiplied on the right in every spelling; one activation-by-activation product."""

    def __init__(self, k=256, n=128):
        super().__init__()
        self.w_mm, self.w_matmul, self.w_at, self.w_addmm = (torch.nn.Parameter(torch.randn(k, n) / 16)
                                                              for _ in range(4))
        self.bias = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):  # x: [B, S, K]
        rows = x.reshape(-1, x.shape[-1])
        scores = x @ x.transpose(-1, -2)  # [B, S, S]: no weight, not a linear
        products = (torch.mm(rows, self.w_mm), torch.matmul(x, self.w_matmul), x @ self.w_at,
                    torch.addmm(self.bias, rows, self.w_addmm))
        return *products, scores


def test_detect_finds_weights_multiplied_on_the_right():
    gm, _ = frozen(ParameterProducts().to(torch.bfloat16))
    Detect()(gm)
    linears = {a.fqn for n in gm.graph.nodes if (a := annotation(n)) and a.kind == "linear"}
    assert linears == {"w_mm", "w_matmul", "w_at", "w_addmm"}


def test_right_multiplied_weights_are_quantized_as_their_transpose():
    torch.manual_seed(0)
    model = ParameterProducts().to(torch.bfloat16)
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="fxquant", options={"recipe": "int8_wo", "inner": "eager"})(x)
        want = model(x)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and rel_err(g, w) < 0.01
    ep = fxquant.export(model, (x,), config={"recipe": "int8_wo"})  # aten spellings: mm, matmul, addmm
    state = {**ep.state_dict, **ep.constants}
    assert not any(v.dtype == torch.bfloat16 and v.dim() == 2 for v in state.values())  # no weight kept in bf16
    with torch.no_grad():
        for g, w in zip(ep.module()(x), want, strict=True):
            assert rel_err(g, w) < 0.01


class TransposedProducts(torch.nn.Module):
    """Weights stored [N, K] as nn.Linear stores them, multiplied as x @ w.T in every spelling of the transpose,
    and F.linear called with keywords; a product with a vector is no layer's."""

    SPELLINGS = ("t", "big_t", "m_t", "transpose", "transpose_neg", "permute", "mm", "keywords")

    def __init__(self, k=256, n=128):
        super().__init__()
        self.w = torch.nn.ParameterDict({name: torch.nn.Parameter(torch.randn(n, k) / 16) for name in self.SPELLINGS})
        self.vector = torch.nn.Parameter(torch.randn(n, k) / 16)

    def forward(self, x):  # x: [B, S, K]
        w, rows = self.w, x.reshape(-1, x.shape[-1])
        return (torch.matmul(x, w["t"].t()), x @ w["big_t"].T, x @ w["m_t"].mT, x @ w["transpose"].transpose(0, 1),
                x @ w["transpose_neg"].transpose(-1, -2), x @ w["permute"].permute(1, 0),
                torch.mm(rows, w["mm"].t()), F.linear(input=x, weight=w["keywords"], bias=None),
                x[0, 0] @ self.vector.T)


def test_weights_multiplied_by_their_transpose_or_through_keywords_are_quantized():
    """x @ w.T was left in high precision, unreported, and F.linear(input=..., weight=...) failed detect with an
    IndexError."""
    torch.manual_seed(0)
    model = TransposedProducts().to(torch.bfloat16)
    x = torch.randn(2, 8, 256, dtype=torch.bfloat16)
    gm, _ = frozen(model)
    Detect()(gm)
    linears = {a.fqn for n in gm.graph.nodes if (a := annotation(n)) and a.kind == "linear"}
    assert linears == {f"w.{name}" for name in TransposedProducts.SPELLINGS}
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="fxquant", options={"recipe": "fp8_row", "inner": "eager"})(x)
        want = model(x)
    for g, w in zip(got[:-1], want[:-1], strict=True):
        assert g.shape == w.shape and 0 < rel_err(g, w) < 0.05  # quantized (fp8 per row), and close
    assert torch.equal(got[-1], want[-1])  # the vector product: untouched
    ep = fxquant.export(model, (x,), config={"recipe": "fp8_row"})  # aten spellings
    weights = [v for v in {**ep.state_dict, **ep.constants}.values() if v.dim() == 2 and v.shape[1] == 256]
    assert sum(v.dtype == torch.bfloat16 for v in weights) == 1  # the vector's weight alone stays bf16
    with torch.no_grad():
        for g, w in zip(ep.module()(x)[:-1], want[:-1], strict=True):
            assert 0 < rel_err(g, w) < 0.05


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_weights_quantized_in_row_chunks_equal_the_whole(monkeypatch, recipe, poison):
    """quantize_weight bounds its temporaries by quantizing rows in chunks: bit for bit the reference's result, per
    tensor scales and NaN poison included."""
    from fxquant.numerics import reference as R
    from fxquant.quantization import weight_quantization

    monkeypatch.setattr(weight_quantization, "CHUNK_ELEMENTS", 256 * 256)
    w = torch.randn(640, 256, dtype=torch.bfloat16)  # two whole chunks of 256 rows and a part
    if poison:
        w[300, 17] = float("nan")  # in the second chunk: a per-tensor scale is poisoned whole, a block one locally
    got = weight_quantization.quantize_weight(w, recipe)
    scheme = RECIPES[recipe]
    want = R.quantize(w, scheme.weight_fmt, scheme.weight_granularity, symmetric=scheme.symmetric,
                      scale_mode=scheme.scale_mode)
    for field in ("data", "scale", "global_scale", "zero_point", "row_scale"):
        a, b = getattr(got, field), getattr(want, field)
        same_bits = a is not None and b is not None and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))
        assert (a is None and b is None) or (a.shape == b.shape and same_bits)


def test_a_static_nvfp4_global_scale_gives_the_dynamic_result_and_must_be_finite():
    from fxquant.numerics import reference as R

    w = torch.randn(64, 128)
    dynamic = R.quantize(w, "nvfp4")
    static = R.quantize(w, "nvfp4", scale=dynamic.global_scale)
    assert torch.equal(static.data, dynamic.data) and torch.equal(static.scale.view(torch.uint8),
                                                                    dynamic.scale.view(torch.uint8))
    with pytest.raises(ValueError, match="global scale must be finite"):
        R.quantize(w, "nvfp4", scale=float("inf"))


def test_a_buffer_multiplied_on_the_right_is_no_linear():
    """In an export graph buffers are get_attr constants too; only a parameter on the right makes a linear."""

    class BufferProduct(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(256, 128))
            self.w = torch.nn.Parameter(torch.randn(256, 128))

        def forward(self, x):
            return x @ self.table, x @ self.w

    gm = torch.export.export(BufferProduct(), (torch.randn(4, 256),)).module()
    FreezeParams(None)(gm)
    Detect()(gm)
    assert [a.fqn for n in gm.graph.nodes if (a := annotation(n)) and a.kind == "linear"] == ["w"]
