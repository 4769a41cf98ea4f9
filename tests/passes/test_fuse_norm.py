"""fuse_norm: norm -> fp8 quantizers become one op (with the residual add when there is one), numbers unchanged."""

import copy

import pytest
import torch
import torch.nn as nn
from hf_models import dynamo_graph
from models import rel_err
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import fxquant.ops  # noqa: F401
from fxquant.compile.pipeline import prepare
from fxquant.config import QuantConfig
from fxquant.passes.cleanup import Cleanup
from fxquant.passes.fuse_norm import FuseNorm
from fxquant.passes.quantize_linear import QuantizeLinear
from fxquant.passes.state import PipelineState

OPS = torch.ops.fxquant
D = 256


class NormThenLinears(nn.Module):
    """norm(x + r) feeds two linears; the sum is also the next residual."""

    def __init__(self, norm, residual=True):
        super().__init__()
        self.norm, self.residual = norm, residual
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, 128, bias=False)

    def forward(self, x, r):  # x, r: [B, S, D]
        h = x + r if self.residual else x
        n = self.norm(h)
        return self.q(n), self.k(n), h


NORMS = {
    "rms_norm": lambda: nn.RMSNorm(D, eps=1e-6),
    "layer_norm": lambda: nn.LayerNorm(D),
    "llama_rms_norm": lambda: LlamaRMSNorm(D, eps=1e-6),
}


def state(recipe="fp8_block"):
    return PipelineState(QuantConfig(recipe=recipe))


def captured(model, *inputs):
    """The pipeline's graph after quantize_linear, before any fusion, and the captured inputs."""
    gm, example_inputs = dynamo_graph(model, *inputs, fullgraph=True)
    gm = prepare(gm, state(), example_inputs)
    QuantizeLinear(state())(gm)
    return gm, example_inputs


def count(gm, op):
    return sum(node.target is op for node in gm.graph.nodes)


def model_and_inputs(norm, residual=True):
    torch.manual_seed(0)
    model = NormThenLinears(NORMS[norm](), residual).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.norm.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # not the identity init: the weight must matter
    x = torch.randn(2, 8, D, dtype=torch.bfloat16)
    return model, x, torch.randn_like(x)


@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_and_quantizers_become_one_op_with_the_same_numbers(norm, residual):
    model, x, r = model_and_inputs(norm, residual)
    gm, inputs = captured(model, x, r)
    unfused = [t.clone() for t in gm(*inputs)]
    assert count(gm, OPS.quantize_fp8.default) == 2
    assert FuseNorm(state())(gm).modified and not FuseNorm(state())(gm).modified
    Cleanup()(gm)
    fused_op = OPS.add_norm_quant_fp8.default if residual else OPS.norm_quant_fp8.default
    assert count(gm, fused_op) == 1 and count(gm, OPS.quantize_fp8.default) == 0
    with torch.no_grad():
        q, k, *h = gm(*inputs)  # dynamo returns h only when it is not an input
    assert len(h) == residual and (not residual or torch.equal(h[0], unfused[2]))  # rounded as the add rounds
    if norm != "llama_rms_norm":
        # Statistics summed in another order can flip a few fp8 codes: a small fraction of fp8's own error.
        assert rel_err(q, unfused[0]) < 5e-3 and rel_err(k, unfused[1]) < 5e-3
    else:
        # The hand-written form rounds to bf16 twice where the kernel rounds once, which flips more codes (~1.5%
        # apart): the fused output must be no further from the fp32 model than the unfused one.
        exact = copy.deepcopy(model).float()(x.float(), r.float())
        for fused, plain, ref in zip((q, k), unfused, exact, strict=False):
            assert rel_err(fused, ref) <= 1.05 * rel_err(plain, ref)


def test_norm_read_by_a_high_precision_consumer_is_left_alone():
    model, x, r = model_and_inputs("rms_norm")
    model.k = nn.Linear(D, 100, bias=False).to(torch.bfloat16)  # N = 100: not fp8_block aligned, stays bf16
    gm, _ = captured(model, x, r)
    assert not FuseNorm(state())(gm).modified and count(gm, OPS.quantize_fp8.default) == 1


def test_per_tensor_quantizers_are_left_alone():
    model, x, r = model_and_inputs("rms_norm")
    graphs = []
    torch._dynamo.reset()
    torch.compile(model, backend=lambda gm, inputs: graphs.append((gm, inputs)) or gm.forward)(x, r)
    gm = prepare(graphs[0][0], state(), graphs[0][1])
    QuantizeLinear(state("fp8_tensor"))(gm)
    assert not FuseNorm(state())(gm).modified


def test_backend_uses_the_fused_op_end_to_end():
    model, x, r = model_and_inputs("llama_rms_norm")
    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend="fxquant", options={"inner": "eager"})(x, r)
        ref = model(x, r)
    assert rel_err(out[0], ref[0]) < 0.05 and torch.equal(out[2], ref[2])


class TwoNormsOfOneSum(nn.Module):
    """Two norms of one residual sum: the first fusion's sum becomes the second norm's input. parallel: both norms
    run before either linear, as in Falcon's and GPT-J's parallel attention and MLP, so the second norm's nodes
    sit between the first norm and its quantizer."""

    def __init__(self, parallel=False):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
        self.q = nn.Linear(D, D, bias=False)
        self.k = nn.Linear(D, D, bias=False)
        self.parallel = parallel

    def forward(self, x, r):
        h = x + r
        if self.parallel:
            n1, n2 = self.norm1(h), self.norm2(h)
            return self.q(n1), self.k(n2), h
        return self.q(self.norm1(h)), self.k(self.norm2(h)), h


@pytest.mark.parametrize("parallel", [False, True], ids=["sequential", "parallel"])
def test_a_norm_of_an_earlier_fusions_sum_fuses_too(parallel):
    """parallel: the fused sum was placed at the first quantizer, after the second norm that reads it ("used before
    it has been defined" at compile time)."""
    torch.manual_seed(0)
    model = TwoNormsOfOneSum(parallel).to(torch.bfloat16)
    x = torch.randn(2, 8, D, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    gm, inputs = captured(model, x, r)
    unfused = [t.clone() for t in gm(*inputs)]
    assert FuseNorm(state())(gm).modified
    Cleanup()(gm)
    assert count(gm, OPS.add_norm_quant_fp8.default) == 1 and count(gm, OPS.norm_quant_fp8.default) == 1
    assert count(gm, OPS.quantize_fp8.default) == 0
    with torch.no_grad():
        q, k, h = gm(*inputs)
    assert torch.equal(h, unfused[2])
    assert rel_err(q, unfused[0]) < 5e-3 and rel_err(k, unfused[1]) < 5e-3
