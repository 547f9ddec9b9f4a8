"""Every module that cites docs/architecture.md names a section that exists there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r"docs/architecture\.md([^)]*)\)")


def _headings() -> set[str]:
    out, fenced = set(), False
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(line.lstrip("#").strip())
    return out


def test_cited_sections_exist() -> None:
    headings = _headings()
    cited = 0
    for path in sorted([*ROOT.glob("moerl/**/*.py"), *ROOT.glob("tools/**/*.py")]):
        for match in CITATION.finditer(path.read_text(encoding="utf-8")):
            sections = [" ".join(s.split()) for s in re.findall(r'"([^"]+)"', match.group(1))]
            where = f"{path.relative_to(ROOT)}: {match.group(0)!r}"
            assert sections, f"{where} names no section"
            for section in sections:
                assert section in headings, f"{where}: no section {section!r} in {DOC.name}"
            cited += 1
    assert cited >= 12  # the modules that cite the design
