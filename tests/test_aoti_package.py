"""An AOTInductor package of a quantized model runs in a process that never imports fxquant. The slowest test of the
GPU suite (minutes to build the package there): conftest.py starts it first."""

import subprocess
import sys

import pytest
import torch

import fxquant


class Logits(torch.nn.Module):
    """A causal LM's logits for a prompt, without a cache: the program AOTInductor packages below."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def test_an_aoti_package_of_an_fp8_row_llama_runs_where_fxquant_is_not_imported(tmp_path):
    """fxquant.package compiles the program's fxquant ops into the package (their torch ops, and on a GPU their Triton
    kernels): a process that never imports fxquant runs it, and each position's logits lie within the fake-quantized
    bound the program's own lie in; on the CPU they equal the program's. Before, the package called
    `fxquant::linear_fp8` through Python's registry: `RuntimeError: Could not find schema for fxquant::linear_fp8`."""
    from hf_models import VOCAB, decoder, fake_quantized, within_bound

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # On the GPU the control goes first: the Llama's package takes minutes to build, the control's seconds.
    if device == "cuda" and (broken := aoti_fails_on_a_plain_linear(tmp_path, device)):
        pytest.skip(f"AOTInductor here cannot run a package without fxquant either: {broken}")
    model = decoder("llama").to(device)
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        program = fxquant.export(Logits(model), (ids,), config={"recipe": "fp8_row"})
        assert "fxquant.linear_fp8.default" in {str(n.target) for n in program.graph.nodes}
        path = fxquant.package(program, tmp_path / "llama.pt2")
        exact, plain = (Logits(fake_quantized(model, "fp8_row", exact=e))(ids)[0].float() for e in (True, False))
        eager, ours = Logits(model)(ids)[0].float(), program.module()(ids)[0].float()
    ids_path, out_path = tmp_path / "ids.pt", tmp_path / "out.pt"
    torch.save(ids, ids_path)
    code = (
        "import sys, torch\n"
        f"run = torch._inductor.aoti_load_package({str(path)!r})\n"
        f"out = run(torch.load({str(ids_path)!r}))\n"
        "assert 'fxquant' not in sys.modules, 'the package imported fxquant'\n"
        f"torch.save(out, {str(out_path)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    if done.returncode != 0 and device == "cpu" and (broken := aoti_fails_on_a_plain_linear(tmp_path, device)):
        pytest.skip(f"AOTInductor here cannot run a package without fxquant either: {broken}")
    assert done.returncode == 0, done.stderr[-2000:]
    packaged = torch.load(out_path)[0].float()
    assert not within_bound(ours, exact, plain, eager)
    assert not within_bound(packaged, exact, plain, eager)
    if device == "cpu":  # the same reference ops, compiled into C++ with the program's roundings
        assert torch.equal(packaged, ours)


def aoti_fails_on_a_plain_linear(tmp_path, device: str) -> str | None:
    """The control for the package test: AOTInductor's package of a bf16 nn.Linear, loaded and run in a fresh process.
    None where it runs; else how it failed. On the H200 machine (torch 2.11.0+cu130), every CUDA package segfaults
    while it loads, fxquant or not (docs/decisions/0016-aoti-cuda-packages-segfault-on-the-gpu-machine.md)."""
    linear = torch.nn.Linear(16, 16, bias=False).to(device, torch.bfloat16)
    x = torch.randn(2, 16, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        path = torch._inductor.aoti_compile_and_package(torch.export.export(linear, (x,)),
                                                        package_path=str(tmp_path / "plain.pt2"))
    torch.save(x, tmp_path / "plain_x.pt")
    code = f"import torch\ntorch._inductor.aoti_load_package({path!r})(torch.load({str(tmp_path / 'plain_x.pt')!r}))\n"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    except subprocess.TimeoutExpired:
        return "a plain nn.Linear's package did not finish in 120 s"
    return None if done.returncode == 0 else f"a plain nn.Linear's package exits with {done.returncode}"
