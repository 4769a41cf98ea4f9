"""Worker processes for a benchmark whose rows may crash or hang. A worker runs its (path, batch) items in order
and prints a row for each; one that dies, or prints nothing for row_timeout seconds, has its item failed, with the
error it printed or the stack it hung in, and a fresh worker goes on with the rest."""

from __future__ import annotations

import faulthandler
import json
import queue
import re
import subprocess
import threading

ROW = "ROW "  # prefix of a worker's result lines
# A traceback's last line, or the first line of a crash's dump: what a failed row quotes.
EXCEPTION_LINE = re.compile(r"[\w.]+(Error|Exception|Failed)\b|Fatal Python error")
STACK_AT = 0.75  # a row still running at this share of row_timeout dumps its stack (the rest covers imports)
TAIL_LINES = 40  # lines of a quiet worker's output shown when its row fails: the stack faulthandler dumped


def print_row(row: dict) -> None:
    print(ROW + json.dumps(row), flush=True)


def dump_stack_if_hung(row_timeout: float) -> None:
    """In a worker, before each row: a row that hangs prints where, just before the parent gives up on it."""
    faulthandler.dump_traceback_later(STACK_AT * row_timeout)


def stop_stack_dump() -> None:
    """In a worker, after its last row."""
    faulthandler.cancel_dump_traceback_later()


def failed(row: dict) -> bool:
    return row["check"].startswith(("failed", "not run"))


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
        lines, last, error, tail, hung = queue.Queue(), "no output", None, [], False
        threading.Thread(target=_pump, args=(worker.stdout, lines), daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=row_timeout)
            except queue.Empty:  # no row in time: the item is marked failed below
                worker.kill()
                last, error, hung = f"no row within {row_timeout} s", None, True
                break
            if line is None:
                break
            if line.startswith(ROW):
                rows.append(json.loads(line[len(ROW):]))
                items, tail = items[1:], []
                print(rows[-1], flush=True)
            else:  # kernel tables, warnings, why a peer did not import, the stack of a row that hangs
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
            if quiet:
                print("".join(tail), end="", flush=True)
            print(rows[-1], flush=True)
            if hung:
                rows += [{"path": path, "batch": other, "check": f"not run: batch {batch} hung"}
                         for same, other in items if same == path]
                items = [item for item in items if item[0] != path]
    return rows
