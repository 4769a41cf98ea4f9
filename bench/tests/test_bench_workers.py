"""bench.workers: rows come back in order, and a worker that crashes or hangs fails its item, not the run."""
import sys
from pathlib import Path

from bench import workers

ROOT = Path(__file__).resolve().parents[1]

# A worker: prints a row per item; the item ("crash", b) raises, ("hang", b) sleeps past any timeout, and
# ("quit", b) exits cleanly without its row.
WORKER = """
import json, sys, time
sys.path.insert(0, ROOT)
from bench import workers
def hang_here():
    time.sleep(60)
workers.dump_stack_on_signal()
for path, batch in json.loads(sys.argv[sys.argv.index("--worker") + 1]):
    if path == "crash":
        raise ValueError(f"bad batch {batch}")
    if path == "hang":
        hang_here()
    if path == "quit":
        sys.exit(0)
    workers.print_row({"path": path, "batch": batch, "check": "ok"})
""".replace("ROOT", repr(str(ROOT)))


def run(items, row_timeout=30.0):
    return workers.run([sys.executable, "-c", WORKER], items, row_timeout, quiet=True)


def test_rows_in_order():
    rows = run([("a", 1), ("a", 2), ("b", 1)])
    assert [(r["path"], r["batch"], r["check"]) for r in rows] == [("a", 1, "ok"), ("a", 2, "ok"), ("b", 1, "ok")]


def test_a_crash_fails_its_item_with_the_error_and_a_fresh_worker_goes_on():
    rows = run([("a", 1), ("crash", 1), ("crash", 2), ("b", 1)])
    assert [(r["path"], r["batch"]) for r in rows] == [("a", 1), ("crash", 1), ("crash", 2), ("b", 1)]
    assert rows[1]["check"] == "failed (rc 1): ValueError: bad batch 1"
    assert rows[2]["check"] == "failed (rc 1): ValueError: bad batch 2"  # a crash is tried again at the next batch
    assert rows[3]["check"] == "ok" and workers.failed(rows[1]) and not workers.failed(rows[3])


def test_a_hang_fails_its_path_at_every_batch_shows_where_and_the_run_goes_on(capsys):
    rows = run([("hang", 1), ("a", 1), ("hang", 2)], row_timeout=3.0)
    assert [(r["path"], r["batch"], r["check"]) for r in rows] == [
        ("hang", 1, "failed (rc -9): no row within 3.0 s"), ("hang", 2, "not run: batch 1 hung"), ("a", 1, "ok")]
    assert workers.failed(rows[1])
    assert "in hang_here" in capsys.readouterr().out  # the stack the worker printed before it was killed


def test_a_worker_that_ends_without_its_row_fails_the_item_instead_of_looping():
    rows = run([("quit", 1), ("a", 1)])
    assert [(r["path"], r["batch"], r["check"]) for r in rows] == [("quit", 1, "failed (rc 0): no output"),
                                                                   ("a", 1, "ok")]


def test_the_first_phase_gives_each_peer_batch_a_worker_and_starts_the_longest():
    from bench.decode import warm_groups

    items = [(path, batch) for path in ("inductor", "fxquant:fp8_row", "torchao:fp8_row", "gemlite:fp8")
             for batch in (1, 16)]
    assert warm_groups(items) == [[("gemlite:fp8", 1)], [("gemlite:fp8", 16)], [("torchao:fp8_row", 1)],
                                  [("torchao:fp8_row", 16)], [("inductor", 1), ("inductor", 16)],
                                  [("fxquant:fp8_row", 1), ("fxquant:fp8_row", 16)]]


def test_the_first_phase_runs_no_more_workers_than_the_free_memory_holds():
    from bench.decode import warm_jobs

    gib = 2**30
    assert warm_jobs(4, 140 * gib, 60 * gib) == 2  # four 60 GiB workers on a 140 GiB GPU ran out of memory
    assert warm_jobs(8, 140 * gib, 10 * gib) == 8
    assert warm_jobs(4, 20 * gib, 60 * gib) == 1  # one worker at least: the timed phase needs the same memory anyway


def test_the_first_phase_worker_estimate_grows_with_the_batch_and_counts_the_prefill_logits():
    import argparse

    from bench.decode import worker_bytes

    args = argparse.Namespace(layers=2, hidden=512, vocab=1000, prefill=64, steps=8, batches=[1])
    one = worker_bytes(args)
    args.batches = [1, 16]
    sixteen = worker_bytes(args)
    cache_and_logits = lambda batch: 2 * 2 * batch * 72 * 1 * 128 * 2 + batch * 64 * 1000 * 2
    assert sixteen - one == cache_and_logits(16) - cache_and_logits(1)


def test_items_that_crashed_in_the_first_phase_are_timed_again_and_hung_ones_are_not():
    from bench.decode import to_time

    items = [("a", 1), ("a", 16), ("b", 1), ("b", 16), ("c", 1)]
    cold = {("a", 1): {"check": "finite"}, ("a", 16): {"check": "failed (rc 1): torch.OutOfMemoryError: CUDA out"},
            ("b", 1): {"check": "failed (rc -9): no row within 240 s"}, ("b", 16): {"check": "not run: batch 1 hung"}}
    assert to_time(items, cold) == [("a", 1), ("a", 16), ("c", 1)]
