"""Worker processes for a benchmark whose rows may crash or hang. A worker runs its (path, batch) items in order
and prints a row for each; one that dies, or prints nothing for row_timeout seconds, has its item failed, with the
error it printed or the stack it hung in, and a fresh worker goes on with the rest."""

from __future__ import annotations

import faulthandler
import json
import queue
import re
import signal
import subprocess
import threading
import time

ROW = "ROW "  # prefix of a worker's result lines
# A traceback's last line, or the first line of a crash's dump: what a failed row quotes.
EXCEPTION_LINE = re.compile(r"[\w.]+(Error|Exception|Failed)\b|Fatal Python error")
DUMP_SIGNAL = signal.SIGUSR1  # a hung worker prints its stack on this, just before it is killed
DUMP_WAIT = 2.0  # seconds the stack gets to arrive
TAIL_LINES = 40  # lines of a quiet worker's output shown when its row fails, before the stack it hung in


def print_row(row: dict) -> None:
    print(ROW + json.dumps(row), flush=True)


def dump_stack_on_signal() -> None:
    """In a worker, once: DUMP_SIGNAL prints every thread's stack. The parent sends it only to a worker it is about
    to kill. A dump on a timer comes from faulthandler's watchdog thread, which reads the frames of threads that keep
    running: twice a worker died of SIGSEGV in the middle of one, its row still running (torchao fp8_row's, and
    gemlite fp8's 112 s into a cold autotune)."""
    faulthandler.register(DUMP_SIGNAL, all_threads=True)


HUNG = "no row within"


def failed(row: dict) -> bool:
    return row["check"].startswith(("failed", "not run"))


def hung(row: dict) -> bool:
    """The item hung, or was not run because its path hung at another batch."""
    return failed(row) and (HUNG in row["check"] or row["check"].endswith("hung"))


def _lines_within(lines: queue.Queue, seconds: float) -> list[str]:
    """The lines that arrive in `seconds`, or until the output ends."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            break
        got.append(line)
    return got


def _pump(stream, lines: queue.Queue):
    """Each line of a worker's output into `lines`, then None at its end."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def run(command: list[str], items: list[tuple[str, int]], row_timeout: float, quiet: bool = False) -> list[dict]:
    """Workers (`command` with `--worker ITEMS_JSON`) over the items until all have a row. A path that hung is not
    run at its other batches: it would hang them too, and the run stays bounded. A quiet run prints its rows, and a
    worker's output only where an item failed."""
    rows = []
    while items:
        worker = subprocess.Popen([*command, "--worker", json.dumps(items)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        lines, last, error, tail, stack, timed_out = queue.Queue(), "no output", None, [], [], False
        threading.Thread(target=_pump, args=(worker.stdout, lines), daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=row_timeout)
            except queue.Empty:  # no row in time: the item is marked failed below, with the stack it hung in
                worker.send_signal(DUMP_SIGNAL)
                stack = _lines_within(lines, DUMP_WAIT)
                worker.kill()
                last, error, timed_out = f"{HUNG} {row_timeout} s", None, True
                break
            if line is None:
                break
            if line.startswith(ROW):
                rows.append(json.loads(line[len(ROW):]))
                items, tail = items[1:], []
                print(rows[-1], flush=True)
            else:  # kernel tables, warnings, why a peer did not import
                last = line.rstrip() or last
                error = last if EXCEPTION_LINE.match(last) else error
                tail = (tail + [line])[-TAIL_LINES:]
                if not quiet:
                    print(line, end="", flush=True)
        worker.wait()
        if items:  # it died, hung, or ended without the row: the item fails, the rest go to a fresh worker
            path, batch = items.pop(0)
            rows.append({"path": path, "batch": batch,
                         "check": f"failed (rc {worker.returncode}): {(error or last)[:160]}"})
            print("".join((tail if quiet else []) + stack), end="", flush=True)
            print(rows[-1], flush=True)
            if timed_out:
                rows += [{"path": path, "batch": other, "check": f"not run: batch {batch} hung"}
                         for same, other in items if same == path]
                items = [item for item in items if item[0] != path]
    return rows
