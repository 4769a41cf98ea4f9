"""Pass-level use: a pass whose precondition has not run refuses, naming it, where it would have changed nothing in
silence; the pipeline runs up to any pass."""
import pytest
import torch

from fxquant.compile.pipeline import PASSES, run_pipeline
from fxquant.config import QuantConfig
from fxquant.passes.fuse_norm import FuseNorm
from fxquant.passes.order import PassOrderError, passes_run
from fxquant.passes.quantize_linear import QuantizeLinear
from fxquant.passes.state import PipelineState
from fxquant.passes.upcast import Upcast

X = torch.randn(2, 64, dtype=torch.bfloat16)
MODEL = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Softmax(-1)).to(torch.bfloat16)


def exported():
    return torch.export.export(MODEL, (X,)).module()


@pytest.mark.parametrize("make, missing", [
    (lambda: Upcast(PipelineState(QuantConfig())), "detect"),
    (lambda: QuantizeLinear(PipelineState(QuantConfig())), "detect"),
    (lambda: FuseNorm(PipelineState(QuantConfig())), "detect"),
], ids=["upcast", "quantize_linear", "fuse_norm"])
def test_a_pass_whose_precondition_has_not_run_refuses_naming_it(make, missing):
    """Upcast alone on an exported graph returned modified=False and said nothing: it needs detect's annotations."""
    gm = exported()
    before = [str(node) for node in gm.graph.nodes]
    with pytest.raises(PassOrderError, match=rf"needs {missing} to have run on this graph first.*stop_after="):
        make()(gm)
    assert [str(node) for node in gm.graph.nodes] == before


@pytest.mark.parametrize("stop", PASSES)
def test_the_pipeline_runs_up_to_any_pass(stop):
    result = run_pipeline(exported(), QuantConfig(recipe="fp8_row"), (X,), stop_after=stop)
    ran = passes_run(result.gm)
    assert ran == PASSES[:PASSES.index(stop) + 1]
    quantized = any(str(n.target).startswith("fxquant.") for n in result.gm.graph.nodes)
    assert quantized == (PASSES.index(stop) >= PASSES.index("quantize_linear"))
    # A softmax over a linear of e4m3 operands (about 31 dB each): its probabilities move by a few percent.
    torch.testing.assert_close(result.gm(X), MODEL(X), rtol=0.1, atol=0.02)


def test_an_unknown_pass_name_is_refused_with_the_names():
    with pytest.raises(ValueError, match="no pass 'fuse_norms'; the pipeline's passes: freeze_params, "):
        run_pipeline(exported(), QuantConfig(), (X,), stop_after="fuse_norms")
