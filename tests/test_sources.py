"""The code cites only the project's own files."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]*\.(?:md|py)\b")


def test_every_cited_file_is_in_the_repository():
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    sources = [p for p in (ROOT / "fxquant").rglob("*.py")] + list((ROOT / "bench").glob("*.py"))
    missing = []
    for source in sources:
        for cited in CITED.findall(source.read_text()):
            if not any(f == cited or f.endswith("/" + cited) for f in files):
                missing.append(f"{source.relative_to(ROOT)}: {cited}")
    assert not missing, missing


HISTORY_CITE = re.compile(r'HISTORY(?:\.md)?\s*,\s*"([^"]+)"')


def test_every_cited_history_heading_exists():
    """Code and docs cite bench/HISTORY.md by heading (dates and topics, never the round of work): each citation must
    name a heading there, so that a reader finds the measurement behind a choice."""
    headings = [line.lstrip("#").strip() for line in (ROOT / "bench" / "HISTORY.md").read_text().splitlines()
                if line.startswith("#")]
    sources = [*(ROOT / "fxquant").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "tests").rglob("*.py"),
               ROOT / "README.md", ROOT / "BENCHMARKS.md"]
    missing = []
    for source in sources:
        for cited in HISTORY_CITE.findall(source.read_text()):
            name = re.sub(r"\s*\n\s*(#\s*)?", " ", cited).strip()  # a citation wrapped over comment lines
            if not any(heading.startswith(name) or name in heading for heading in headings):
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, missing
