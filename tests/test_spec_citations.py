"""Every section of the specification the project cites is a section of docs/SPEC.md.

The README says docs/SPEC.md defines every statistic, and the docs, help texts and docstrings send
readers there by section ("SPEC §5d", "(SPEC §3, §8)", "[docs/SPEC.md](docs/SPEC.md) §7"); the
``spec`` of each declared option and metric ("§9") becomes "(SPEC §9)" in ``--help`` and a column of
``headatlas metrics``. A citation of a section the page lacks sends the reader nowhere. Pure text:
the files are read, nothing is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "SPEC.md"

SECTION = r"§\d+[a-z]?(?:–\d+[a-z]?)?(?![A-Za-z0-9])"  # "§5d", "§8p", a range "§1–3"
# a section heading of SPEC.md: "## 9. Causal effects …", "### 5d. Intervals …", "### 8p. Synthetic probe …"
HEADING = re.compile(r"^#{2,4} (\d+[a-z]?)\. ", re.MULTILINE)
# "SPEC §5d", "SPEC §3, §8", "SPEC §1, or §5b", "SPEC §9 beside §7", "SPEC §1–3", "SPEC.md) §5 and
# §5b", "SPEC.md §7"
CITATION = re.compile(rf"SPEC(?:\.md\)?)? ({SECTION}(?:,? (?:and |or |beside )?{SECTION})*)")
# a string literal that is nothing but sections: the ``spec`` of a declared option or metric
SPEC_FIELD = re.compile(rf"[\"']({SECTION}(?:, {SECTION})*)[\"']")
ONE = re.compile(r"§(\d+[a-z]?)(?:–(\d+[a-z]?))?")

CITING = ("service", "cli", "workers", "migrations", "benchmarks")


def spec_sections() -> set[str]:
    """The sections docs/SPEC.md has, by their headings: ``{"1", …, "5d", "8p", …}``."""
    return set(HEADING.findall(SPEC.read_text(encoding="utf-8")))


def citing_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in CITING:
        files += sorted(p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)
    return [p for p in files if p != SPEC]


def citations(path: Path, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """``(line, section)`` for each section ``pattern`` cites in ``path`` (section without §)."""
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        for match in pattern.finditer(line):
            for first, last in ONE.findall(match.group(1)):
                out += [(number, first)] + ([(number, last)] if last else [])  # a range: both ends
    return out


def missing(found: list[tuple[Path, int, str]], sections: set[str]) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}: SPEC §{s}" for p, n, s in found if s not in sections]


def test_spec_headings_are_read() -> None:
    """The headings parse (else every citation below would be reported missing, or none checked)."""
    assert {"1", "2", "3", "4", "5", "5b", "5c", "5d", "6", "7", "8", "8p"} <= spec_sections()


def test_every_cited_section_exists() -> None:
    sections = spec_sections()
    found = [(p, n, s) for p in citing_files() for n, s in citations(p, CITATION)]
    assert len(found) > 300, f"only {len(found)} citations found: is the pattern still right?"
    gone = missing(found, sections)
    assert not gone, f"{len(gone)} citations of sections docs/SPEC.md does not have:\n" + "\n".join(gone)


def test_every_declared_spec_field_names_a_section() -> None:
    """``spec="§9"`` of an analysis option and the sections of each metric (``headatlas metrics``)."""
    sections = spec_sections()
    files = [ROOT / "service" / "analysis_options.py", ROOT / "service" / "metrics.py"]
    found = [(p, n, s) for p in files for n, s in citations(p, SPEC_FIELD)]
    assert len(found) > 30, f"only {len(found)} spec fields found: is the pattern still right?"
    gone = missing(found, sections)
    assert not gone, f"{len(gone)} spec fields name sections docs/SPEC.md does not have:\n" + "\n".join(gone)


def test_the_specs_own_references_exist() -> None:
    """SPEC.md's references to its own sections ("§5d's groups", "the trivial orders of §9")."""
    sections = spec_sections()
    found = [(SPEC, n, s) for n, s in citations(SPEC, re.compile(f"({SECTION})"))]
    gone = missing(found, sections)
    assert not gone, f"{len(gone)} references in docs/SPEC.md to sections it does not have:\n" + "\n".join(gone)
