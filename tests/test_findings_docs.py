"""The figures the README and docs/findings.md state are those benchmarks/findings.py printed.

The script writes its output to docs/findings-output.md (the shipped excerpt, `make findings`) and,
for the development corpus, docs/findings-output-dev.md; docs/findings.md holds each verbatim between
two markers naming the file, and every figure of the prose around them (and of README's "What the
numbers say" and its example table) must appear in one of them. Nothing is re-analysed here: run
`make findings` and rewrite the prose when the numbers change.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FINDINGS = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")
OUTPUTS = (
    "docs/findings-output.md",
    "docs/findings-output-dev.md",
    "docs/findings-output-effects.md",
    "docs/findings-output-effects-smollm2.md",
    "docs/findings-output-long-range.md",
    "docs/findings-output-streaming.md",
    "docs/findings-output-toy.md",
)
BLOCK = re.compile(r"<!-- begin (\S+) -->\n(.*?)<!-- end \1 -->", re.S)
OUTPUT = "\n".join((ROOT / path).read_text(encoding="utf-8") for path in OUTPUTS)

# a decimal (1.17, 0.263), a head count ("48 of 72"), a window count ("52 windows")
FIGURE = re.compile(r"(?<![\w.§-])(\d+\.\d+|\d+ of \d+|[\d,]+ windows)(?![\w.]\d)")


def figures(text: str) -> list[str]:
    # code blocks and spans show commands, options and columns (`--select top:0.05`), not measured
    # figures (the README's example table is checked row by row below)
    prose = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))
    return [m.group(1) for m in FIGURE.finditer(prose)]


def stated_in_output(figure: str) -> bool:
    """``figure`` as a whole number in the output: 0.29 is not found inside 10.29 or 0.295."""
    return re.search(rf"(?<![\d.]){re.escape(figure)}(?![\d])", OUTPUT) is not None


def readme_section(title: str) -> str:
    start = README.index(f"## {title}")
    return README[start : README.index("\n## ", start + 1)]


def prose_of_findings() -> str:
    return BLOCK.sub("", FINDINGS)


def test_figures_are_found_in_their_own_text():
    # the pattern the checks below rely on
    assert figures("layer 2, 1.06× [1.05, 1.06]; 48 of 72 heads; 1,067 windows; §5.2; `top:0.05`") == [
        "1.06",
        "1.05",
        "1.06",
        "48 of 72",
        "1,067 windows",
    ]


def test_a_figure_is_found_only_whole(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "OUTPUT", "lift 10.29 [0.295, 1.1]; 48 of 72 heads")
    assert stated_in_output("1.1") and stated_in_output("48 of 72")
    assert not stated_in_output("0.29") and not stated_in_output("0.2") and not stated_in_output("8 of 72")


def test_findings_holds_the_script_output_verbatim():
    blocks = {path: held for path, held in BLOCK.findall(FINDINGS)}
    assert sorted(blocks) == sorted(OUTPUTS)
    for path, held in blocks.items():
        assert held.strip() == (ROOT / path).read_text(encoding="utf-8").strip(), (
            f"{path} differs from docs/findings.md"
        )


@pytest.mark.parametrize(
    "where, text",
    [
        ("docs/findings.md", prose_of_findings()),
        ("README: What the numbers say", readme_section("What the numbers say")),
    ],
)
def test_every_stated_figure_comes_from_the_script(where, text):
    found = figures(text)
    assert found, f"{where}: no figures found (the pattern or the section moved)"
    missing = sorted({f for f in found if not stated_in_output(f)})
    assert not missing, f"{where} states figures that docs/findings-output.md does not hold: {missing}"


def test_readme_example_table_rows_are_the_script_rows():
    block = readme_section("What you get").split("```text", 1)[1].split("```", 1)[0]
    rows = [line for line in block.splitlines() if re.match(r"^ \d", line)]
    assert len(rows) == 3
    for row in rows:
        assert row in OUTPUT, row


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("findings_script", ROOT / "benchmarks" / "findings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_head_counts_by_value_and_by_lower_bound():
    heads = [
        {"m": 1.2, "m_lo": 1.05},  # both above 1
        {"m": 1.1, "m_lo": 0.9},  # value only
        {"m": 0.95, "m_lo": 0.8},  # neither
        {"m": None, "m_lo": None},  # undefined: neither
    ]
    assert _script().count_rule(heads, "m", 1.0) == (2, 1)


def test_the_output_is_copied_between_its_markers_only(tmp_path):
    script = _script()
    page = tmp_path / "findings.md"
    page.write_text(
        "prose 1.06\n<!-- begin docs/findings-output.md -->\nold\n<!-- end docs/findings-output.md -->\ntail\n",
        encoding="utf-8",
    )
    assert script.copy_into(page, ROOT / "docs" / "findings-output.md", "new 1.07\n")
    assert page.read_text(encoding="utf-8") == (
        "prose 1.06\n<!-- begin docs/findings-output.md -->\nnew 1.07\n<!-- end docs/findings-output.md -->\ntail\n"
    )
    # a page without the file's markers is left alone
    assert not script.copy_into(page, ROOT / "docs" / "findings-output-dev.md", "x\n")
