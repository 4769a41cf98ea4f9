"""fuse_gated_mlp: a Llama MLP's gate/up product, SiLU quantizer and down product become one op, with the three ops'
bits; block-scaled weights, biased gate/up products and products read elsewhere stay apart. On the GPU a decode runs
the two-GEMM kernels, and its logits are the unfused graph's."""

import pytest
import torch
from hf_models import VOCAB, compiled, compiled_results, decoder, static_decode

from fxquant.kernels import gated_mlp_fp8 as kernels

FUSED = torch.ops.fxquant.gated_mlp_fp8.default
SILU = torch.ops.fxquant.silu_mul_quantize_fp8.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GENERATOR = torch.Generator().manual_seed(5)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 3), generator=GENERATOR)


def pipeline(model, ids, **options):
    forward, results = compiled_results(model, {"inner": "eager", **options}, fullgraph=True)
    with torch.no_grad():
        logits = forward(ids, use_cache=False).logits
    return results[0].gm, logits.float()


def count(gm, target) -> int:
    return sum(node.target is target for node in gm.graph.nodes)


def test_each_mlp_becomes_one_op_with_the_unfused_graph_s_numbers():
    model = decoder("llama")
    fused, logits = pipeline(model, PROMPT, recipe="fp8_row")
    apart, logits_apart = pipeline(model, PROMPT, recipe="fp8_row", disable_passes=["fuse_gated_mlp"])
    assert (count(fused, FUSED), count(fused, SILU)) == (2, 0)  # one per layer
    assert (count(apart, FUSED), count(apart, SILU)) == (0, 2)
    assert torch.equal(logits, logits_apart)


def test_block_scaled_weights_stay_apart():
    fused, _ = pipeline(decoder("llama"), PROMPT, recipe="fp8_block")
    assert count(fused, FUSED) == 0 and count(fused, SILU) == 2


class Gated(torch.nn.Module):
    """A gated MLP whose gate product is also read elsewhere where `reused`."""

    def __init__(self, reused: bool):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(256, 512, bias=False)
        self.down = torch.nn.Linear(512, 256, bias=False)
        self.reused = reused

    def forward(self, x):
        g = self.gate(x)
        y = self.down(torch.nn.functional.silu(g) * self.up(x))
        return y + g.sum(-1, keepdim=True) if self.reused else y


@pytest.mark.parametrize(("reused", "fused"), [(False, 1), (True, 0)])
def test_only_an_mlp_whose_products_nothing_else_reads_fuses(reused, fused):
    torch.manual_seed(1)
    model = Gated(reused).to(torch.bfloat16).eval()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    forward, results = compiled_results(model, {"inner": "eager", "recipe": "fp8_row"}, fullgraph=True)
    with torch.no_grad():
        got = forward(x)
    assert count(results[0].gm, FUSED) == fused
    _, apart = compiled_results(model, {"inner": "eager", "recipe": "fp8_row", "disable_passes": ["fuse_gated_mlp"]},
                                fullgraph=True)
    with torch.no_grad():
        assert torch.equal(got, _(x))


@pytest.mark.gpu
def test_a_decode_runs_the_two_gemms_and_gives_the_unfused_logits(monkeypatch):
    """Each decode step's MLPs on the two kernels (the prefill's 8 rows a batch of 2 too: 16 rows); the logits of
    every step equal, bit for bit, those of the graph without the pass."""
    calls = []
    kernel = kernels.silu_mul_rows_fp8
    monkeypatch.setattr(kernels, "silu_mul_rows_fp8", lambda *args, **kw: calls.append(1) or kernel(*args, **kw))
    model = decoder("llama", num_hidden_layers=2).to(DEVICE)
    prompt, steps = PROMPT.to(DEVICE), STEPS.to(DEVICE)
    got = static_decode(model, compiled(model, recipe="fp8_row"), prompt, steps)
    assert len(calls) >= 2 * 4  # two layers, the prefill and three steps
    apart = static_decode(model, compiled(model, recipe="fp8_row", disable_passes=["fuse_gated_mlp"]), prompt, steps)
    assert torch.equal(got, apart)
