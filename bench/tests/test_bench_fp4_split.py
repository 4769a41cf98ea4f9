"""bench.fp4_split's harness on the CPU, the GPU's parts stood in for: each shape times the product's split first and
once, every split is checked before it is timed, a wrong product is reported, left untimed and fails the run once
its tables are printed, and the chain gives its splits to the small weights only."""

import pytest
import torch

import bench.fp4_split as FS


@pytest.fixture
def on_cpu(monkeypatch):
    """Weights of 64 x 128 on the CPU, a fixed time per call, and the splits each product ran at."""
    monkeypatch.setattr(FS, "DEVICE", "cpu")
    monkeypatch.setattr(FS, "fp4_weight", lambda n, k, fmt: {"tiles": torch.zeros(64, 16, dtype=torch.int32),
                                                             "lanes": None, "q": type("Q", (), {"global_scale": None})})
    monkeypatch.setattr(FS, "rotating", lambda make, nbytes: [make(), make()])
    splits = []
    monkeypatch.setattr(FS, "fp4_mma_mm", lambda x, tiles, lanes, fmt, gs, split=None, stages=3: splits.append(
        (x.shape[1], split, stages)))
    monkeypatch.setattr(FS, "graph_time_ms", lambda fn, sets: [fn(*s) for s in sets] and 0.004)
    return splits


def test_each_shape_times_the_products_split_first_and_once(on_cpu, monkeypatch):
    monkeypatch.setattr(FS, "relative_error", lambda x, weight, fmt, split, stages: 1e-3)
    rows = FS.alone("mxfp4", 4096, 4096, [8, 10, 16], [3, 4])
    product = FS.int4_mma_split(4096, 4096)
    assert product == 10  # so the 10 given is not timed twice
    assert [(r["split"], r["stages"]) for r in rows] == [
        (f"{product} (product)", 3), (f"{product} (product)", 4), (8, 3), (8, 4), (16, 3), (16, 4)]
    assert [s for _, s, _ in on_cpu] == [10, 10, 10, 10, 8, 8, 8, 8, 16, 16, 16, 16]  # two weights each
    assert rows[0]["us"] == "4.0" and rows[0]["x bf16"] == "1.00"


def test_a_wrong_product_is_reported_untimed_and_fails_the_run_at_its_end(on_cpu, monkeypatch, capsys):
    monkeypatch.setattr(FS, "relative_error", lambda x, weight, fmt, split, stages: 0.5 if split == 16 else 1e-3)
    rows = FS.alone("nvfp4", 4096, 4096, [16, 8], [3])
    assert [(r["split"], r["us"], r["rel err"]) for r in rows] == [
        ("10 (product)", "4.0", "1.0e-03"), (16, "WRONG", "5.0e-01"), (8, "4.0", "1.0e-03")]
    assert [s for _, s, _ in on_cpu] == [10, 10, 8, 8]  # split 16 never timed
    monkeypatch.setattr(FS, "alone", lambda fmt, n, k, splits, stages: rows if (n, k) == (4096, 4096) else [])
    monkeypatch.setattr(FS, "bf16_chain_ms", lambda xs: 4.0)
    monkeypatch.setattr(FS, "chain", lambda fmt, xs, bf16_ms, splits: [])
    monkeypatch.setattr(FS, "header", lambda: "header")
    monkeypatch.setattr("sys.argv", ["fp4_split"])
    with pytest.raises(SystemExit, match="2 products past the error bound"):  # one wrong row a format
        FS.main()
    assert "WRONG" in capsys.readouterr().out  # the tables were printed first


def test_the_chain_splits_only_the_small_weights(on_cpu, monkeypatch):
    monkeypatch.setattr(FS, "LAYERS", 1)
    monkeypatch.setattr(FS.triton.testing, "do_bench_cudagraph", lambda run, rep, return_mode: run() or 2.0)
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in (4096, 14336)}
    rows = FS.chain("mxfp4", xs, 4.0, [16])
    assert [(r["q/k/v and o split"], r["x bf16"]) for r in rows] == [("product", "2.00"), (16, "2.00")]
    # q/k/v, o, gate/up, down: None leaves the product's split; K = 4096 for all but down
    assert [s for _, s, _ in on_cpu] == [None, None, None, None, 16, 16, None, None]
