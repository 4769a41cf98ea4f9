"""fxquant.export: the program holds fxquant ops and quantized weights; it saves, loads in a fresh process
and runs."""

import subprocess
import sys

import pytest
import torch
from models import rel_err, residual_norm_mlp, tiny_block

import fxquant

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)
CASES = {  # model, inputs, ops the program must hold
    "tiny_block": (tiny_block, (X,), {"fxquant.linear_fp8.default"}),
    # gate and up: one GEMM on merged weights, sliced
    "residual_norm_mlp": (residual_norm_mlp, (X, torch.randn_like(X)),
                          {"fxquant.add_norm_quant_fp8.default", "fxquant.scaled_mm_fp8.default", "aten.slice.Tensor"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_round_trip_in_a_fresh_process(tmp_path, case):
    build, args, ops = CASES[case]
    model = build()
    ep = fxquant.export(model, args, config={"recipe": "fp8_block"})
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert ops <= targets
    state = {**ep.state_dict, **ep.constants}
    assert not any(v.dtype == torch.bfloat16 and v.shape == (512, 256) for v in state.values())  # no bf16 up
    with torch.no_grad():
        expected = ep.module()(*args)
    assert rel_err(expected, model(*args)) < 0.03
    path, x_path, out_path = tmp_path / "model.pt2", tmp_path / "x.pt", tmp_path / "out.pt"
    torch.export.save(ep, path)
    torch.save(args, x_path)
    code = (
        "import torch, fxquant\n"
        f"ep = fxquant.load({str(path)!r})\n"
        f"torch.save(ep.module()(*torch.load({str(x_path)!r})), {str(out_path)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert torch.equal(torch.load(out_path), expected)
