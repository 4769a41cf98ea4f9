"""fuse_linear_norm: o_proj and down_proj join the residual add and norm -> fp8 after them, with the same numbers."""

from collections import Counter

import pytest
import torch
from models import tiny_llama
from torch.fx.passes.infra.pass_base import PassResult

from fxquant import reference as R
from fxquant.config import QuantConfig
from fxquant.passes import run_pipeline
from fxquant.passes.fuse_linear_norm import FuseLinearNorm
from fxquant.report import format_report

ops = torch.ops.fxquant
FUSED, LINEAR, ADD_NORM = (ops.linear_fp8_add_norm_quant.default, ops.linear_fp8.default,
                           ops.add_norm_quant_fp8.default)


def pipeline(model, args, recipe="fp8_block", results=None):
    """The pipeline's graph for the model's dynamo graph, and the output that graph computes; `results` collects
    the whole PipelineResult."""
    results = [] if results is None else results

    def backend(gm, inputs):
        results.append(run_pipeline(gm, QuantConfig(recipe=recipe), inputs))
        return results[-1].gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    return results[0].gm, out


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(2)


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_row"])  # per-tensor activations have no fused norm to join
def test_o_and_down_proj_join_the_norm_after_them_with_the_same_logits(llama, recipe, monkeypatch):
    model, ids = llama
    fused, out = pipeline(lambda ids: model(ids, use_cache=False).logits, (ids,), recipe)
    counts = Counter(node.target for node in fused.graph.nodes)
    # 2 layers: o_proj of both and down_proj of the first feed a residual add and a quantized norm; the last
    # down_proj feeds the final norm, which feeds the lm_head (kept in bf16), so it stays a linear.
    assert (counts[FUSED], counts[ADD_NORM], counts[LINEAR]) == (3, 0, 1)

    monkeypatch.setattr(FuseLinearNorm, "call", lambda self, gm: PassResult(gm, False))
    apart, out_apart = pipeline(lambda ids: model(ids, use_cache=False).logits, (ids,), recipe)
    assert Counter(node.target for node in apart.graph.nodes)[FUSED] == 0
    # The op's reference is the two ops it replaces: the same bits.
    assert torch.equal(out, out_apart)


def test_the_report_names_the_joined_linears(llama):
    model, ids = llama
    results = []
    pipeline(lambda ids: model(ids, use_cache=False).logits, (ids,), results=results)
    report = format_report(results[0].layers, results[0].findings)
    assert ("linears joined with the residual add and norm after them: model.layers.0.self_attn.o_proj, "
            "model.layers.0.mlp.down_proj, model.layers.1.self_attn.o_proj") in report


def test_a_second_run_changes_nothing(llama):
    model, ids = llama
    fused, _ = pipeline(lambda ids: model(ids, use_cache=False).logits, (ids,))
    assert not FuseLinearNorm()(fused).modified


class LinearThenNorm(torch.nn.Module):
    """linear_fp8 -> add_norm_quant_fp8, with the GEMM's output as the add's first or second operand."""

    def __init__(self, gemm_first):
        super().__init__()
        self.gemm_first = gemm_first

    def forward(self, x, r, w, w_scale, norm_w):
        y = LINEAR(x, w, w_scale, None, 128)
        a, b = (y, r) if self.gemm_first else (r, y)
        return ADD_NORM(a, b, norm_w, None, 1e-6, 128, True)


@pytest.mark.parametrize("gemm_first", [True, False], ids=["gemm first", "gemm second"])
def test_the_gemm_may_be_either_operand_of_the_add(gemm_first):
    torch.manual_seed(0)
    qw = R.quantize(torch.randn(256, 512) * 0.05, "fp8_e4m3", ("block", 128, 128))
    args = (torch.randn(2, 8, 512, dtype=torch.bfloat16), torch.randn(2, 8, 256, dtype=torch.bfloat16), qw.data,
            qw.scale, torch.rand(256, dtype=torch.bfloat16) + 0.5)
    gm = torch.fx.symbolic_trace(LinearThenNorm(gemm_first))
    want = gm(*args)
    assert FuseLinearNorm()(gm).modified
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert node.target is FUSED
    assert [a.name if isinstance(a, torch.fx.Node) else a for a in node.args] == [
        "x", "w", "w_scale", 128, "r", "norm_w", None, 1e-6, 128, True]
    got = gm(*args)
    assert all(torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)
               for g, w in zip(got, want, strict=True))


class Reads(torch.nn.Module):
    """A linear_fp8 whose output a second node also reads, or that has a bias: neither may join the norm."""

    def __init__(self, bias):
        super().__init__()
        self.bias = bias

    def forward(self, x, r, w, w_scale, b, norm_w):
        y = LINEAR(x, w, w_scale, b if self.bias else None, 128)
        codes, scales, h = ADD_NORM(y, r, norm_w, None, 1e-6, 128, True)
        return (codes, scales, h) if self.bias else (codes, scales, h, y * 2)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "second reader"])
def test_a_linear_with_a_bias_or_a_second_reader_stays_apart(bias):
    gm = torch.fx.symbolic_trace(Reads(bias))
    assert not FuseLinearNorm()(gm).modified


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [16, 64])
def test_on_the_gpu_the_joined_ops_give_the_unfused_logits(batch, monkeypatch):
    """Decode rows, and K long enough (1024, 2048) that o_proj and down_proj split it: the norm adds the partials."""
    model, _ = tiny_llama(2, hidden=1024, intermediate=2048)
    model = model.cuda()
    ids = torch.randint(0, 300, (batch, 1), device="cuda")
    fused, out = pipeline(lambda ids: model(ids, use_cache=False).logits, (ids,))
    assert Counter(node.target for node in fused.graph.nodes)[FUSED] == 3
    monkeypatch.setattr(FuseLinearNorm, "call", lambda self, gm: PassResult(gm, False))
    _, out_apart = pipeline(lambda ids: model(ids, use_cache=False).logits, (ids,))
    assert torch.equal(out, out_apart)
