"""Writes tests/durations.json, the seconds each test of at least a second took in a run of `.ci/gpu`, from that run's
JUnit XML: `.ci/gpu --junitxml=junit.xml`, then `python3 .ci/durations.py junit.xml`. conftest.py hands the tests
to xdist's workers longest first by it, so that no long test starts last (the GPU suite must end inside one call).
The suite's two commands (`.ci/gpu` and `.ci/gpu --cpu-matrix`) run disjoint tests, so a run's XML updates the
tests it ran and keeps the others' recorded seconds: either command's XML refreshes the file without losing the
other's order."""

import json
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHORTEST_KEPT = 1.0  # seconds: shorter tests keep their collection order at the end


def node_id(classname: str, name: str) -> str | None:
    """pytest's node id of a JUnit test case: the longest prefix of the dotted class name that is a file, then the
    classes within it; xdist's `@group` suffix left off. None where no such file is left (a test since removed)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[end:], name.split("@")[0]])
    return None


def collected() -> set[str]:
    """The node ids the suite collects now: a test removed or renamed since the run keeps no entry."""
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-n",
                              "0"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line.strip() for line in listing.splitlines() if "::" in line}


def merged(recorded: dict[str, float], ran: dict[str, float], tests: set[str]) -> dict[str, float]:
    """The seconds to keep: each test of this run at its new time, or none where it took under SHORTEST_KEPT; each
    test it did not run (the other command's) at its recorded time; only tests the suite still collects."""
    seconds = {**{test: time for test, time in recorded.items() if test not in ran}, **ran}
    return dict(sorted((test, time) for test, time in seconds.items() if test in tests and time >= SHORTEST_KEPT))


def main(junit: str) -> None:
    cases = list(ElementTree.parse(junit).getroot().iter("testcase"))
    total = sum(float(case.get("time")) for case in cases)
    print(f"{junit}: {len(cases)} tests, {total:.0f} worker-seconds")
    ran = {node_id(case.get("classname"), case.get("name")): round(float(case.get("time")), 1) for case in cases}
    path = ROOT / "tests" / "durations.json"
    kept = merged(json.loads(path.read_text()) if path.is_file() else {}, ran, collected())
    path.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"tests/durations.json: {len(kept)} tests of at least {SHORTEST_KEPT} s, {sum(kept.values()):.0f} s in all")


if __name__ == "__main__":
    main(*sys.argv[1:])
