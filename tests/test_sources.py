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
