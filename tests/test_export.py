"""fxquant.export: the program holds fxquant ops and quantized weights; it saves, loads in a fresh process
and runs."""

import subprocess
import sys

import pytest
import torch
from models import rel_err, residual_norm_mlp, tiny_block

import fxquant

X = torch.randn(2, 8, 256, dtype=torch.bfloat16)
BLOCK = {"recipe": "fp8_block"}
CASES = {  # model, inputs, config, ops the program must hold
    "tiny_block": (tiny_block, (X,), BLOCK, {"fxquant.linear_fp8.default"}),
    # gate and up: one GEMM on merged weights, sliced
    "residual_norm_mlp": (residual_norm_mlp, (X, torch.randn_like(X)), BLOCK,
                          {"fxquant.add_norm_quant_fp8.default", "fxquant.scaled_mm_fp8.default", "aten.slice.Tensor"}),
    # per token: SiLU x up with its quantizer after the merged gate/up GEMM
    "residual_norm_mlp_row": (residual_norm_mlp, (X, torch.randn_like(X)), {"recipe": "fp8_row"},
                              {"fxquant.add_norm_quant_fp8.default", "fxquant.scaled_mm_fp8.default",
                               "fxquant.silu_mul_quantize_fp8.default"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_export_round_trip_in_a_fresh_process(tmp_path, case):
    build, args, config, ops = CASES[case]
    model = build()
    ep = fxquant.export(model, args, config=config)
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


def test_an_exported_decode_step_keeps_its_static_cache_writes_in_a_fresh_process(tmp_path):
    """transformers' exportable decoder holds its StaticCache as tensors the program writes in place. Each step of
    the quantized program must lie within the fake-quantized bound, which a program that dropped the writes (each
    step attending to its own token alone) misses; the saved program replays the same steps in a fresh process."""
    from hf_models import VOCAB, decoder, fake_quantized, within_bound
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    model = decoder("llama")
    model.generation_config.cache_implementation = "static"
    tokens = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1))
    path = tmp_path / "decode.pt2"

    def decode(step) -> torch.Tensor:
        return torch.stack([step(input_ids=tokens[:, i:i + 1], cache_position=torch.tensor([i]))[0, -1].float()
                            for i in range(tokens.shape[1])])

    def exportable(m):
        return TorchExportableModuleWithStaticCache(m, batch_size=1, max_cache_len=16)

    with torch.no_grad():
        ep = fxquant.export(exportable(model), (), {"input_ids": tokens[:, :1], "cache_position": torch.tensor([0])},
                            config={"recipe": "int8_wo"})
        torch.export.save(ep, path)  # its cache still empty
        got = decode(ep.module())
        exact, plain = (decode(exportable(fake_quantized(model, "int8_wo", exact=e))) for e in (True, False))
        eager = decode(exportable(model))
        no_history = torch.stack([exportable(model)(input_ids=tokens[:, i:i + 1], cache_position=torch.tensor([0]))
                                  [0, -1].float() for i in range(tokens.shape[1])])
    assert not within_bound(got, exact, plain, eager)
    assert within_bound(no_history, exact, plain, eager)  # a program without its cache writes fails the bound
    assert torch.equal(replayed_in_a_fresh_process(path, tokens, tmp_path), got)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_an_exported_decode_step_attends_with_the_decode_op(tmp_path, monkeypatch, attention):
    """The decode pass runs on export's aten graphs too, SDPA and transformers' eager spelling alike (export writes
    the value cache after the key cache's repeat: a write to another tensor, which the pass lets stand). Enabled
    for the CPU here, where the op runs its fp32 reference. Each step is within twice bf16's own distance of the
    eager model, and the saved program gives the same logits in a fresh process."""
    import copy
    import functools

    from hf_models import VOCAB, angle, decoder
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    from fxquant.compile import pipeline
    from fxquant.passes.decode_attention import DecodeAttention

    monkeypatch.setattr(pipeline, "DecodeAttention", functools.partial(DecodeAttention, devices=("cpu",)))
    model = decoder("llama", attn_implementation=attention)
    model.generation_config.cache_implementation = "static"
    tokens = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    path = tmp_path / "decode.pt2"
    exportable = lambda m: TorchExportableModuleWithStaticCache(m, batch_size=1, max_cache_len=16)

    def decode(step) -> torch.Tensor:
        return torch.stack([step(input_ids=tokens[:, i:i + 1], cache_position=torch.tensor([i]))[0, -1].float()
                            for i in range(tokens.shape[1])])

    with torch.no_grad():
        ep = fxquant.export(exportable(model), (), {"input_ids": tokens[:, :1], "cache_position": torch.tensor([0])},
                            config={"include": []})
        torch.export.save(ep, path)
        got = decode(ep.module())
        eager = decode(exportable(model))
        wide = copy.deepcopy(model).float()
        exact = decode(exportable(wide))
    attends = [node for node in ep.graph.nodes if node.target is torch.ops.fxquant.decode_attention.default]
    assert len(attends) == model.config.num_hidden_layers
    for step in range(len(got)):
        assert angle(got[step], eager[step]) <= 2 * angle(eager[step], exact[step]), step
    assert torch.equal(replayed_in_a_fresh_process(path, tokens, tmp_path), got)


def replayed_in_a_fresh_process(path, tokens, tmp_path) -> torch.Tensor:
    """The last position's logits of each token's decode step, run by the program saved at `path` in a new
    process (which imports fxquant, so the program's ops are registered)."""
    tokens_path, out_path = tmp_path / "tokens.pt", tmp_path / "out.pt"
    torch.save(tokens, tokens_path)
    code = (
        "import torch, fxquant\n"
        f"step, tokens = fxquant.load({str(path)!r}).module(), torch.load({str(tokens_path)!r})\n"
        "out = [step(input_ids=tokens[:, i:i + 1], cache_position=torch.tensor([i]))[0, -1].float()\n"
        f"       for i in range({tokens.shape[1]})]\n"
        f"torch.save(torch.stack(out), {str(out_path)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out_path)
