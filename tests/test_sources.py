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
               ROOT / "README.md", ROOT / "BENCHMARKS.md", *(ROOT / "docs" / "decisions").glob("*.md")]
    missing = []
    for source in sources:
        for cited in HISTORY_CITE.findall(source.read_text()):
            name = re.sub(r"\s*\n\s*(#\s*)?", " ", cited).strip()  # a citation wrapped over comment lines
            if not any(heading.startswith(name) or name in heading for heading in headings):
                missing.append(f"{source.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_each_decision_record_is_cited_by_the_files_it_names():
    """A record in docs/decisions says which files it decided; each of them cites it by file name, so that a reader of
    the code finds the number behind a choice, and a record whose choice left the code shows as uncited."""
    records = sorted((ROOT / "docs" / "decisions").glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records
    uncited = []
    for record in records:
        cited_by = re.search(r"\*\*Cited by\.\*\* (.+?)\.\n", record.read_text(), re.S)
        assert cited_by, f"{record.name} names no file it decided"
        for name in re.findall(r"`([^`]+)`", cited_by.group(1)):
            if record.name not in (ROOT / name).read_text():
                uncited.append(f"{name} does not cite {record.name}")
    assert not uncited, uncited


def test_every_kept_log_is_cited_by_the_benchmarks_or_a_decision():
    """bench/results keeps the logs behind the current numbers (BENCHMARKS.md) and behind the decisions
    (docs/decisions); a log nobody cites belongs to the repository's history, not its tree."""
    citing = "".join(p.read_text() for p in [ROOT / "BENCHMARKS.md", *(ROOT / "docs" / "decisions").glob("*.md")])
    uncited = [p.relative_to(ROOT).as_posix() for p in (ROOT / "bench" / "results").rglob("*")
               if p.is_file() and p.name not in citing]
    assert not uncited, uncited
