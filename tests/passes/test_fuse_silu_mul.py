"""fuse_silu_mul: a Llama MLP's silu(gate) * up and its fp8 quantizer become one op, numbers unchanged but for the
product's one rounding; products that something else reads, and per-tensor quantizers, stay apart."""

import pytest
import torch
from hf_models import VOCAB, compiled, compiled_results, decoder, fake_quantized, static_decode, within_bound
from models import rel_err

FUSED = torch.ops.fxquant.silu_mul_quantize_fp8.default
GENERATOR = torch.Generator().manual_seed(4)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 2), generator=GENERATOR)


@pytest.fixture(scope="module")
def llama():
    return decoder("llama"), PROMPT


def pipeline(model, ids, **options):
    forward, results = compiled_results(model, {"inner": "eager", **options}, fullgraph=True)
    with torch.no_grad():
        logits = forward(ids, use_cache=False).logits
    return results[0].gm, logits.float()


def count(gm, *targets) -> int:
    return sum(node.target in targets for node in gm.graph.nodes)


@pytest.mark.parametrize("recipe", ["fp8_row", "fp8_block"])  # per token, and rows of 128
def test_each_mlp_s_product_and_quantizer_become_one_op(llama, recipe):
    model, ids = llama
    fused, logits = pipeline(model, ids, recipe=recipe)
    apart, logits_apart = pipeline(model, ids, recipe=recipe, disable_passes=["fuse_silu_mul"])
    assert count(fused, FUSED) == 2 and count(apart, FUSED) == 0  # one per layer
    silu = {torch.nn.functional.silu, torch.ops.aten.silu.default}
    assert count(fused, *silu) == 0 and count(apart, *silu) == 2
    assert not torch.equal(logits, logits_apart)  # the product rounded once, not after silu and again after mul


def test_a_fused_decode_stays_within_the_bound_of_its_fake_quantized_copy():
    """The fused op rounds silu(gate) * up once where the unfused graph rounds twice: a difference the bound (the
    exact fake-quantized copy against a plain one) covers."""
    model = decoder("llama")
    got = static_decode(model, compiled(model, recipe="fp8_row"), PROMPT, STEPS)
    copies = fake_quantized(model, "fp8_row", exact=True), fake_quantized(model, "fp8_row", exact=False), model
    exact, plain, eager = (static_decode(m, m, PROMPT, STEPS) for m in copies)
    assert not within_bound(got, exact, plain, eager)


class Gated(torch.nn.Module):
    """A gated MLP whose product (or silu) is also read elsewhere, unless `plain`."""

    def __init__(self, reuse: str):
        super().__init__()
        self.gate, self.up = torch.nn.Linear(256, 512, bias=False), torch.nn.Linear(256, 512, bias=False)
        self.down = torch.nn.Linear(512, 256, bias=False)
        self.reuse = reuse

    def forward(self, x):
        s = torch.nn.functional.silu(self.gate(x))
        h = s * self.up(x)
        if self.reuse == "product":
            return self.down(h) + h.sum(-1, keepdim=True)
        if self.reuse == "silu":
            return self.down(h) + s.sum(-1, keepdim=True)
        if self.reuse == "both silu":  # silu(gate) * silu(up), the first silu read elsewhere: the second one fuses
            both = s * torch.nn.functional.silu(self.up(x))
            return self.down(both) + s.sum(-1, keepdim=True)
        return self.down(h)


@pytest.mark.parametrize(("reuse", "recipe", "fused"), [("plain", "fp8_row", 1), ("product", "fp8_row", 0),
                                                        ("silu", "fp8_row", 0), ("both silu", "fp8_row", 1),
                                                        ("plain", "fp8_tensor", 0)])
def test_only_a_product_read_by_its_quantizer_alone_fuses(reuse, recipe, fused):
    torch.manual_seed(1)
    model = Gated(reuse).to(torch.bfloat16).eval()
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    forward, results = compiled_results(model, {"inner": "eager", "recipe": recipe}, fullgraph=True)
    with torch.no_grad():
        out = forward(x).float()
        assert rel_err(out, model(x).float()) < 0.1  # fp8's error, fused or not
    assert count(results[0].gm, FUSED) == fused
