"""fuse_gemm_epilogue: an fp8 GEMM feeding only a residual add + norm + quantizer, or SiLU x up + quantizer over its
two halves, becomes one op. Off by default; the option enable_passes runs it. On the CPU the ops run their
references, which give the unfused graph's bits, so a decode run fused must equal the same run without the pass, bit
for bit (the kernel is compared with the two kernels it stands for in tests/kernels/test_gemm_fp8_epilogue.py)."""

import pytest
import torch
from hf_models import compiled_results, decoder, static_decode

FUSED, FUSED_SILU = "scaled_mm_fp8_add_norm_quant", "scaled_mm_fp8_silu_mul_quantize"
NORM, SILU, GEMM, LINEAR = "add_norm_quant_fp8", "silu_mul_quantize_fp8", "scaled_mm_fp8", "linear_fp8"


def count(gm, op: str) -> int:
    """The graph's calls of fxquant's op by that name."""
    return sum(node.target == getattr(torch.ops.fxquant, op).default for node in gm.graph.nodes)


def decode(model, recipe, **options):
    """Logits of a prefill and three steps over a StaticCache, and the decode step's graph."""
    forward, graphs = compiled_results(model, options={"recipe": recipe, "inner": "eager", **options},
                                       keep=lambda result: result.gm)
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 512, (2, 5), generator=generator)
    steps = torch.randint(0, 512, (2, 3), generator=generator)
    return static_decode(model, forward, prompt, steps), graphs[-1]


@pytest.mark.parametrize(("arch", "recipe", "fused"), [
    ("llama", "fp8_row", True),
    ("qwen2", "fp8_row", True),
    ("mistral", "fp8_row", True),
    ("phi3", "fp8_row", True),  # a residual dropout that drops nothing in eval; gate and up split by chunk(2)
    ("llama", "fp8_block", False),  # 1x128 and 128x128 block scales: the kernel takes none
])
def test_enabled_each_projection_takes_the_row_work_after_it_with_the_unfused_bits(arch, recipe, fused):
    model = decoder(arch)
    got, graph = decode(model, recipe, enable_passes="fuse_gemm_epilogue")
    want, default = decode(model, recipe)
    layers = model.config.num_hidden_layers
    gemms = lambda gm: count(gm, GEMM) + count(gm, LINEAR)
    # The norms after the o- and down-projections, but the last layer's: the final norm feeds the bf16 lm_head.
    expected = 2 * layers - 1 if fused else 0
    assert count(default, FUSED) == 0 and count(default, NORM) == 2 * layers - 1
    assert count(graph, FUSED) == expected and count(graph, NORM) == 2 * layers - 1 - expected
    # the merged gate/up product and SiLU x up's quantizer: one op a layer
    assert count(default, SILU) == layers and count(graph, FUSED_SILU) == (layers if fused else 0)
    assert count(graph, SILU) == (0 if fused else layers)
    assert gemms(graph) == gemms(default) - expected - (layers if fused else 0)
    assert torch.isfinite(got).all() and torch.equal(got, want)


def test_the_report_names_each_gemm_that_took_the_work_after_it(capsys):
    model = decoder("llama")
    decode(model, "fp8_row", enable_passes="fuse_gemm_epilogue", report=True)
    report = capsys.readouterr().out
    start = report.index("GEMMs with the norm or SiLU after them in their epilogue:")
    listed = report[start:report.index("fxquant report", start) if "fxquant report" in report[start:] else None]
    for layer in ("layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj+up_proj", "layers.0.mlp.down_proj"):
        assert f"model.{layer}" in listed, (layer, listed)


def test_enable_passes_names_only_passes_off_by_default():
    model = decoder("llama")
    ids = torch.randint(0, 512, (1, 4))
    for name, why in [("fuse_norm", "runs by default"), ("fuse_everything", "no such pass")]:
        compiled = torch.compile(model, backend="fxquant", options={"recipe": "fp8_row", "enable_passes": name})
        with pytest.raises(Exception, match=rf"enable_passes: {name} \({why}\).*off by default, which it may run: "
                                            "fuse_gemm_epilogue"):
            compiled(ids)
        torch._dynamo.reset()
