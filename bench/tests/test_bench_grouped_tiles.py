"""bench.grouped_tiles' harness at small shapes (on the CPU under Triton's interpreter, on the GPU where there is one),
its timers stood in for: every variant's product is checked against the reference before it is timed, tensor-descriptor
variants run for both scalings, scale layouts for channel groups only, and a wrong product stops the run naming its
variant."""

import pytest
import torch

import bench.grouped_tiles as GT

SMALL = dict(BLOCK_M=16, BLOCK_N=64)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels need the interpreter on the CPU


def stand_in_scaled_grouped_mm(a, b_t, a_scale, b_scale, offs):
    """`torch._scaled_grouped_mm`'s contract as torch's checks state it (a row-major, b column-major, 1-D row scales,
    [E, N] column scales, fp32 scales), then each expert's dequantized product: CUTLASS's op runs on Hopper only."""
    E, K, N = b_t.shape
    assert a.stride(-1) == 1 and b_t.stride(-2) == 1 and a.shape[1] == K
    assert a_scale.shape == (a.shape[0],) and b_scale.shape == (E, N)
    assert a_scale.dtype == b_scale.dtype == torch.float32
    out = torch.zeros(a.shape[0], N, dtype=torch.float32, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].float() * a_scale[start:end, None]) @ (b_t[e].float() * b_scale[e])
        start = end
    return out.to(torch.bfloat16)


@pytest.fixture
def on_cpu(monkeypatch):
    """Experts of 128 x 256 over 40 tokens routed top-2, small tiles, and a fixed time per call."""
    monkeypatch.setattr(GT, "DEVICE", DEVICE)
    monkeypatch.setattr(GT, "SHAPES", {"gate/up": (128, 256)})
    monkeypatch.setattr(GT, "VARIANTS", {"the plan": {}, "small tiles": SMALL,
                                         "TMA small tiles": dict(TMA=True, **SMALL),
                                         "N-contiguous scales": {"scales": "N-contiguous", **SMALL}})

    def routed(tokens, seed):
        logits = torch.randn(tokens, GT.EXPERTS, generator=torch.Generator().manual_seed(seed))
        return None, logits.topk(GT.TOP_K, dim=-1).indices.to(DEVICE), None

    monkeypatch.setattr(GT, "routed", routed)
    monkeypatch.setattr(GT, "peer_available", lambda: True)
    monkeypatch.setattr(GT, "scaled_grouped_mm", stand_in_scaled_grouped_mm)
    monkeypatch.setattr(GT, "graph_time_ms", lambda fn, sets: [fn(*s) for s in sets] and 0.5)
    monkeypatch.setattr(GT, "time_ms", GT.graph_time_ms)
    monkeypatch.setattr(GT, "graph_output", lambda fn, args: fn(*args))


def test_every_variant_is_checked_then_timed_and_scale_layouts_only_for_channel_groups(on_cpu):
    rows = GT.sweep(40, "gate/up", list(GT.VARIANTS))
    assert [r["variant"] for r in rows] == [
        "bf16 torch._grouped_mm", "dense fp8 kernel expert by expert", "torch._scaled_grouped_mm (rowwise, CUTLASS)",
        "row: the plan", "row: small tiles",
        "row: TMA small tiles", "channel groups: the plan", "channel groups: small tiles",
        "channel groups: TMA small tiles", "channel groups: N-contiguous scales",
        "W4A8 in a graph (codes made e4m3, grouped)", "W4A8 as it runs (expert by expert, cuBLAS)"]
    checked = [r for r in rows if r["rel err"] != "-"]
    assert len(checked) == 9 and all(float(r["rel err"]) <= GT.AGREEMENT for r in checked)
    assert all(r["us"] == "500" and r["x bf16"] == "1.00" for r in rows)


def test_a_wrong_product_stops_the_run_naming_its_variant(on_cpu, monkeypatch):
    real = GT.G.grouped_fp8_mm
    monkeypatch.setattr(GT.G, "grouped_fp8_mm", lambda *a, config=None, **k: real(*a, config=config, **k) * (
        1.5 if config == SMALL else 1))
    with pytest.raises(SystemExit, match="row: small tiles: relative error 0.5"):
        GT.sweep(40, "gate/up", list(GT.VARIANTS))


def test_a_peer_that_refuses_is_reported_and_the_sweep_goes_on(on_cpu, monkeypatch, capsys):
    def refuses(*args):
        raise RuntimeError("CUTLASS: unsupported layout\nsecond line")

    monkeypatch.setattr(GT, "scaled_grouped_mm", refuses)
    rows = GT.sweep(40, "gate/up", ["the plan"])
    assert "torch._scaled_grouped_mm refused: CUTLASS: unsupported layout" in capsys.readouterr().out
    assert "torch._scaled_grouped_mm (rowwise, CUTLASS)" not in [r["variant"] for r in rows]
    assert [r["variant"] for r in rows][-1] == "W4A8 as it runs (expert by expert, cuBLAS)"
