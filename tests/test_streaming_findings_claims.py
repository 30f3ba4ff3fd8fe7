"""docs/findings.md's section on streaming heads and the seed's long-range claim (SPEC §10), set
against what benchmarks/streaming_findings.py printed (docs/findings-output-streaming.md, copied
verbatim into the page): the verdict, each part's reading, the windows measured, and each depth's
KV heads that can stream. Nothing is measured here: when the numbers change, run the script and
rewrite the prose."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = (ROOT / "docs" / "findings-output-streaming.md").read_text(encoding="utf-8")
PAGE = (ROOT / "docs" / "findings.md").read_text(encoding="utf-8")
TITLE = "## Streaming heads: the long-range claim in SPEC §10's terms"


def section() -> str:
    start = PAGE.index(TITLE)
    return PAGE[start : PAGE.index("\n## ", start + 1)]


def found(pattern: str, text: str) -> tuple[str, ...]:
    match = re.search(pattern, text)
    assert match, f"no match for {pattern!r} (the sentence or the output changed its wording)"
    return match.groups()


def test_the_page_holds_the_output_verbatim():
    block = PAGE.split("<!-- begin docs/findings-output-streaming.md -->\n", 1)[1]
    assert block.split("<!-- end docs/findings-output-streaming.md -->", 1)[0] == OUTPUT


def test_the_verdict_is_the_outputs():
    (verdict,) = found(r"Verdict on the seed's long-range claim: (\w+)", OUTPUT)
    assert found(r"The verdict: \*\*(\w+)\*\*", section()) == (verdict,)


def test_each_parts_reading_is_the_outputs():
    for part, opening in (("a", "**KV heads that can stream at"), ("b", "**Long-range lift")):
        (reading,) = found(rf"- \({part}\) [^:]+: (\w+)", OUTPUT)
        start = section().index(f"- {opening}")
        bullet = section()[start : section().index("\n- ", start)]
        assert found(rf"Part \({part}\): \*\*(\w+)\*\*", bullet) == (reading,), part


def test_the_windows_are_the_outputs():
    streamed = found(r"streaming effects on (\d+) windows of (\d+) tokens", OUTPUT)
    assert found(r"streaming effects of (\d+) windows of (\d+) tokens", section()) == streamed
    short = found(r"and (\d+) windows of 128 tokens", OUTPUT)
    assert found(r"(\d+) windows of 128 tokens", section()) == short


def test_each_depths_streaming_kv_heads_are_the_outputs():
    for depth in ("early", "middle", "late"):
        row = next(line for line in OUTPUT.splitlines() if line.startswith(f"| {depth} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        kv, can = cells[1], cells[2].split()[0]
        assert f"{depth}: {can} of {kv}" in section(), depth
