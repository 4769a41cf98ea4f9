"""bench.layer_chain's harness on the CPU, with the GPU's parts (weights, caches, the copy bandwidth, graph timing)
stood in for: the variants named run, each is checked against the first, and the times come back by batch."""

import re

import torch

import bench.layer_chain as LC
from bench.chain_parts import INTER, fixed_codes


def test_time_variants_checks_each_variant_against_the_first_and_keeps_the_named(monkeypatch, capsys):
    monkeypatch.setattr(LC, "DEVICE", "cpu")
    monkeypatch.setattr(LC, "weights", lambda layers: [None] * layers)
    monkeypatch.setattr(LC, "caches", lambda layers, batch, context: [None] * layers)
    monkeypatch.setattr(LC, "copy_bandwidth_gbs", lambda: 3000.0)
    monkeypatch.setattr(LC, "header", lambda: "header")
    timed = []
    monkeypatch.setattr(LC, "graph_time_ms", lambda fn, sets: timed.append(fn()) or 3.2)
    args = LC.arguments(__doc__).parse_args(["--layers", "32", "--batches", "1", "4", "--variants", "b", "a", "d"])

    def refused(state):
        raise RuntimeError("out of resource: shared memory")

    seen = []
    variants = {"a": lambda s: s["h"] * 2, "b": lambda s: s["h"] * 3, "c": lambda s: s["h"] * 0, "d": refused}
    results = LC.time_variants(args, variants, lambda name, out, first, state: seen.append(
        (name, state["batch"], first is None or torch.equal(first, state["h"] * 2))))
    assert [list(r) for r in results] == [["a", "b"], ["a", "b"]]  # "c" not named; "d" refused, reported
    assert results[0]["a"] == 100.0  # 3.2 ms over 32 layers
    assert seen == [("a", 1, True), ("b", 1, True), ("a", 4, True), ("b", 4, True)]
    assert len(timed) == 4 and timed[-1].shape == (4, LC.HIDDEN)
    printed = capsys.readouterr().out
    assert "| 1 | 100.0 us" in re.sub(" +", " ", printed)
    assert "1 d not run: RuntimeError: out of resource" in printed


def test_the_same_bits_check_refuses_a_moved_bit():
    state = {"batch": 1}
    out = torch.ones(2)
    LC.same_bits("a", out, None, state)
    LC.same_bits("b", out.clone(), out, state)
    moved = out.clone()
    moved[1] = torch.nextafter(moved[1], torch.tensor(2.0))
    try:
        LC.same_bits("c", moved, out, state)
    except AssertionError as err:
        assert "bits moved" in str(err)
    else:
        raise AssertionError("a moved bit passed")


def test_the_fixed_codes_are_made_once_a_batch(monkeypatch):
    # made where the quantizer's kernel runs: the GPU where there is one (the CPU's needs Triton's interpreter)
    monkeypatch.setattr(LC, "DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    state = {"batch": 2}
    first = fixed_codes(state)
    assert fixed_codes(state) is first
    assert [tuple(codes.shape) for codes, _ in first.values()] == [(2, LC.HIDDEN), (2, INTER)]
    assert all(codes.dtype == torch.float8_e4m3fn and scales.shape == (2, 1) for codes, scales in first.values())


def test_the_chain_s_attention_launches_in_the_plan_and_count_given_and_as_it_plans_after():
    from bench.chain_tiles import attention_launch
    from fxquant.kernels import decode_attention as DA

    cpu = torch.device("cpu")
    shipped = DA.launch_plan(128, 1024, False, cpu)
    with attention_launch(None, (2, 1, 4, 128, 3)):
        assert DA.launch_plan(128, 1024, False, cpu)[0] == (2, 1, 4, 128, 3)
    with attention_launch(2, None):
        assert DA.launch_plan(128, 1024, False, cpu) == (shipped[0], 2)
    assert DA.launch_plan(128, 1024, False, cpu) == shipped
