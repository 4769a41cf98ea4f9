"""The report a user reads: lines within 120 columns, honest with nothing quantized, why a weight SQNR is absent,
what recipe="auto" chose; and 3-D weights counted as experts only where a batched product reads them."""

import re
import warnings

import pytest
import torch
from hf_models import decoder
from models import tiny_block

import fxquant
from fxquant.compile.report import WIDTH

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)


def compiled_report(model, x, capsys, **options) -> str:
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="fxquant", options={"inner": "eager", "report": True, **options})(x)
    return capsys.readouterr().out


class LongNames(torch.nn.Module):
    """A layer whose name is longer than its row leaves room for, and a reason that wraps."""

    def __init__(self):
        super().__init__()
        self.encoder_stack_with_a_very_long_module_path_name = torch.nn.ModuleDict(
            {"attention_output_projection_dense_layer": torch.nn.Linear(256, 256)})
        self.odd = torch.nn.Linear(256, 200)

    def forward(self, x):
        stack = self.encoder_stack_with_a_very_long_module_path_name
        return self.odd(stack["attention_output_projection_dense_layer"](x))


@pytest.mark.parametrize("model", ["llama", "long_names"])
def test_every_line_fits_120_columns(model, capsys):
    """The report was up to 205 columns wide: each row carried its recipe's description and its reasons."""
    if model == "llama":
        out = compiled_report(decoder("llama"), torch.randint(0, 512, (1, 8)), capsys, recipe="fp8_block")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the misaligned layer's lint warning
            out = compiled_report(LongNames().to(torch.bfloat16), X, capsys, recipe="int4_wo")
        lines = out.splitlines()
        name = "encoder_stack_with_a_very_long_module_path_name.attention_output_projection_dense_layer"
        row = lines.index(name)  # on a line of its own, its cells under it
        assert lines[row + 1].split()[:2] == ["256x256", "int4_wo"]
    assert max(map(len, out.splitlines())) <= WIDTH, max(out.splitlines(), key=len)


def test_with_nothing_quantized_the_totals_say_so(capsys):
    """It said "1.00x smaller" for a model with nothing quantized."""
    out = compiled_report(tiny_block(), X, capsys, include=[])
    assert "nothing quantized, the model keeps its size" in out and "smaller" not in out
    assert "weight SQNR dB" not in out.splitlines()[-1]


def test_an_absent_weight_sqnr_says_why(capsys):
    """quantize_ measures the linears it quantizes, not experts, and a layer quantized before has no weight left."""
    model = fxquant.quantize_(decoder("mixtral"), {"recipe": "int4_wo", "report": True})
    first = capsys.readouterr().out
    assert re.search(r"^model\.layers\.0\.mlp\.experts\.gate_up_proj .* -$", first, re.M)
    assert "weight SQNR -: not measured: quantize_ measures the linear layers it quantizes, not experts" in first
    fxquant.quantize_(model, {"recipe": "int4_wo", "report": True})
    assert "weight SQNR -: quantized before this call (quantize_ or a checkpoint)" in capsys.readouterr().out


def test_the_report_says_what_auto_chose_and_at_what_sqnr(capsys):
    out = compiled_report(tiny_block(), X, capsys, recipe="auto", min_sqnr_db=25)
    lines = out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("up "))
    chosen = lines[row].split()[2]
    sqnr = float(re.fullmatch(r"\s*auto chose it: output SQNR (\d+\.\d) dB", lines[row + 1]).group(1))
    assert chosen in fxquant.RECIPES and sqnr >= 25
    assert re.search(r"recipe='auto' measured 3 layer\(s\) on the sample inputs: \w+ x \d", out)


class PatchEmbeddings(torch.nn.Module):
    """ViT's 3-D parameters: a class token [1, 1, D] and position embeddings [1, T + 1, D], added to activations."""

    def __init__(self, dim=256, tokens=8):
        super().__init__()
        self.cls_token = torch.nn.Parameter(torch.randn(1, 1, dim))
        self.position_embeddings = torch.nn.Parameter(torch.randn(1, tokens + 1, dim))
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):  # x: [B, T, D]
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.position_embeddings
        scores = x @ x.transpose(1, 2)  # attention reaches them only through the activations
        return self.proj(scores.softmax(-1) @ x)


class Experts(torch.nn.Module):
    """A MoE layer fxquant does not recognise: every expert [E, N, K] over every row through einsum, then a mean."""

    def __init__(self, experts=4, dim=256):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, dim, dim) / 16)

    def forward(self, x):  # x: [T, D]
        return torch.einsum("tk,enk->ten", x, self.weight.transpose(1, 2)).mean(1)


def test_3d_weights_are_experts_only_where_a_batched_product_reads_them(capsys):
    """ViT's position embeddings and CLS token were reported and linted as "3-D expert weights in no expert product
    fxquant recognises"."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vit = compiled_report(PatchEmbeddings(), torch.randn(2, 8, 256), capsys, recipe="fp8_row")
    assert "3-D expert weights" not in vit and "other 3-D and larger weights (position embeddings, class tokens)" in vit
    assert not [w for w in caught if "expert" in str(w.message)]
    with pytest.warns(UserWarning, match=r"3-D expert weights in no expert product fxquant recognises hold 1,048,576"):
        experts = compiled_report(Experts(), torch.randn(8, 256), capsys, recipe="fp8_row")
    assert "3-D expert weights in no expert product fxquant recognises 1,048,576" in experts


def test_quantize_reports_3d_parameters_by_their_module():
    """quantize_ has no graph: a 3-D parameter of a module named for experts counts as experts, another not."""
    vit, experts = PatchEmbeddings(), Experts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no experts warning for the position embeddings
        fxquant.quantize_(vit, "fp8_row")
    with pytest.warns(UserWarning, match="3-D expert weights"):
        fxquant.quantize_(experts, "fp8_row")
