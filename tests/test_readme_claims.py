"""Each claim of the README, set against what the command behind it printed.

`make findings` (benchmarks/findings.py) runs the README's commands on the shipped excerpt, with
the default model and with SmolLM2 (``--decoder``), and writes what they print to
docs/findings-output.md (the development corpus's to docs/findings-output-dev.md).
tests/test_findings_docs.py checks that every figure of the README's prose is found somewhere in
that output; this module reads each claim where it is stated and the value it claims where the
output states it, and compares the two: "63 (head, role) are earned" against the roles line of
the output, "none on the excerpt" against the decoder's count of induction heads, and so on.
Nothing is analysed here: when the code changes the numbers, run `make findings` and rewrite the
claims it contradicts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
EXCERPT = (ROOT / "docs" / "findings-output.md").read_text(encoding="utf-8")
DEV = (ROOT / "docs" / "findings-output-dev.md").read_text(encoding="utf-8")

NUM = r"(\d+(?:\.\d+)?)"
CI = rf"{NUM} \[{NUM}, {NUM}\]"
S = r"\s+"  # the README wraps its prose anywhere


def one(pattern: str, text: str, where: str) -> tuple[str, ...]:
    found = re.search(pattern, text)
    assert found, f"{where}: no match for {pattern!r} (the sentence or the output changed its wording)"
    return found.groups()


def table_row(text: str, heading: str, first: str) -> list[str]:
    """The cells of the markdown table row under ``heading`` whose first cell is ``first``."""
    section = text[text.index(heading) :]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} under {heading!r}")


def numbers_section() -> str:
    start = README.index("## What the numbers say")
    return README[start : README.index("\n## ", start + 1)]


def layer_2() -> tuple[str, ...]:
    cells = table_row(EXCERPT, "### Layers", "2")
    share, lift, dm = cells[2], cells[3], cells[4]
    return (share, lift, *one(CI, dm, "layer 2 of the output"))


def strongest_head() -> tuple[str, ...]:
    block = EXCERPT.split("### Heads", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    first = next(line for line in block.splitlines() if re.match(r"^ \d", line))
    layer, head, _share, _lift, dm = first.split(None, 4)
    return (layer, head, *one(CI, dm, "the heads table of the output"))


def control_repetition() -> tuple[str, ...]:
    seeds = table_row(EXCERPT, "Each control's largest head per role metric", "repetition")[3:]
    values = sorted(float(cell.split()[0]) for cell in seeds)
    return f"{values[0]:g}", f"{values[-1]:g}"


def decoder_induction() -> int:
    return int(table_row(EXCERPT, "### Decoder", "induction")[1])


# (what is claimed, the README's wording, the output's value)
CLAIMS = [
    (
        "windows of the excerpt",
        lambda: one(r"the shipped excerpt: (\d+) windows\)", numbers_section(), "README"),
        lambda: one(r"Corpus: wiki_excerpt\.txt: \d+ documents, (\d+) windows", EXCERPT, "output"),
    ),
    (
        "layer 2: within-sentence share, lift against all pairs and against the same distances",
        lambda: one(
            rf"Layer 2 keeps {NUM} of its most similar pairs{S}within{S}a{S}sentence,{S}{NUM}×{S}all{S}pairs{S}—"
            rf"{S}but{S}{CI}",
            numbers_section(),
            "README",
        ),
        layer_2,
    ),
    (
        "heads above 1 against the same distances: by value, by lower bound",
        lambda: one(
            rf"(\d+) of 72 heads have a value above 1,{S}(\d+) of 72 a lower bound above 1", numbers_section(), "README"
        ),
        lambda: one(
            r"within_sentence_lift_dm above 1: value above 1: (\d+) of 72 heads; lower bound above 1: (\d+) of 72",
            EXCERPT,
            "output",
        ),
    ),
    (
        "the most within-sentence head",
        lambda: one(rf"the strongest,{S}layer{S}(\d+){S}head{S}(\d+),{S}is{S}{CI}", numbers_section(), "README"),
        strongest_head,
    ),
    (
        "sentence-bound role: no head",
        lambda: ("0",) if re.search(rf"No{S}head{S}earns{S}the{S}sentence-bound{S}role", numbers_section()) else (),
        lambda: (table_row(EXCERPT, "### Roles", "sentence-bound")[1],),
    ),
    (
        "the strongest repetition head",
        lambda: one(
            rf"Layer{S}(\d+){S}head{S}(\d+){S}pairs{S}repeated{S}words{S}at{S}{NUM}×{S}\[{NUM},{S}{NUM}\]",
            numbers_section(),
            "README",
        ),
        lambda: one(rf"top 4\): layer (\d+) head (\d+): [^;]*?, {CI};", EXCERPT, "output"),
    ),
    (
        "the controls' largest repetition heads",
        lambda: one(rf"random-weights{S}controls{S}reach{S}{NUM}–{NUM}", numbers_section(), "README"),
        control_repetition,
    ),
    (
        "attention to . and , per layer",
        lambda: one(rf"near{S}uniform\*\*{S}\({NUM}–{NUM}×{S}per{S}layer\)", numbers_section(), "README"),
        lambda: one(rf"`\.` `,` vs uniform, every layer: {NUM}–{NUM}", EXCERPT, "output"),
    ),
    (
        "attention to [CLS] in layers 1-5, and heads whose lower bound is above 10",
        lambda: one(
            rf"{NUM}–{NUM}×{S}uniform{S}in{S}layers{S}1–5:{S}a{S}sink{S}\((\d+){S}of{S}72{S}heads{S}with{S}a{S}lower",
            numbers_section(),
            "README",
        ),
        lambda: (
            *one(rf"\[CLS\] vs uniform, layers 1–5: {NUM}–{NUM}", EXCERPT, "output"),
            *one(
                r"\[CLS\] vs uniform above 10: value above: \d+ of 72 heads; lower bound above: (\d+) of 72",
                EXCERPT,
                "output",
            ),
        ),
    ),
    (
        "anchors: the median head's share, heads above half",
        lambda: one(
            rf"most{S}frequent{S}token{S}in{S}{NUM}{S}of{S}the{S}windows;{S}(\d+){S}of{S}72{S}heads{S}exceed{S}half",
            numbers_section(),
            "README",
        ),
        lambda: one(rf"median head {NUM},.*?heads above 0\.5: (\d+) of 72", EXCERPT, "output"),
    ),
    (
        "roles earned on the excerpt, stable ones, replicate groups",
        lambda: one(
            rf"(\d+){S}\(head,{S}role\){S}are{S}earned{S}on{S}it,{S}(\d+){S}of{S}them{S}stable{S}across{S}halves"
            rf"{S}of{S}its{S}(\d+){S}replicate{S}groups",
            numbers_section(),
            "README",
        ),
        lambda: (
            *one(r"(\d+) \(head, role\) earned, (\d+) of them stable", EXCERPT, "output"),
            *one(r"\((\d+) groups; halves", EXCERPT, "output"),
        ),
    ),
    (
        "the development corpus: windows, documents, groups, roles earned and stable",
        lambda: one(
            rf"On{S}(\d+){S}windows{S}of{S}the{S}development{S}corpus{S}\((\d+){S}documents,{S}(\d+){S}replicate"
            rf"{S}groups;[^)]*\){S}(\d+){S}are{S}earned{S}and{S}(\d+){S}hold",
            numbers_section(),
            "README",
        ),
        lambda: (
            *reversed(one(r": (\d+) documents, (\d+) windows", DEV, "dev output")),
            *one(r"\((\d+) groups; halves", DEV, "dev output"),
            *one(r"(\d+) \(head, role\) earned, (\d+) of them stable", DEV, "dev output"),
        ),
    ),
]


@pytest.mark.parametrize("claim, stated, printed", CLAIMS, ids=[c[0] for c in CLAIMS])
def test_readme_claim_is_what_the_output_says(claim, stated, printed):
    assert stated() == printed(), f"README ({claim}) says {stated()}, the output {printed()}: rewrite the README"


def test_the_controls_earn_no_role_as_the_readme_says():
    """ "On the development data the random-weights controls (three seeds) earn no role on any of
    their 72 heads": every control column of the roles table holds 72 heads without a role."""
    assert re.search(rf"controls{S}\(three{S}seeds\){S}earn{S}no{S}role{S}on{S}any{S}of{S}their{S}72{S}heads", README)
    controls = table_row(DEV, "### Roles", "none established")[3:]
    assert controls == ["72", "72", "72"], controls


def test_the_bad_inputs_the_readme_counts_are_the_table_s():
    """The "At scale" section's count of bad inputs is the one docs/reliability.md states, which
    tests/test_bad_inputs.py holds to the length of its table."""
    reliability = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    tried = one(r"\*\*(\d+) bad inputs; all \d+ give one clean error\*\*", reliability, "docs/reliability.md")
    assert one(rf"(\d+){S}kinds{S}of{S}bad{S}input", README, "README") == tried


def induction_line() -> str:
    return next(line for line in README.splitlines() if "query roles --run smol --role induction" in line)


def test_the_decoder_windows_and_groups_the_readme_names_are_the_output_s():
    comment = induction_line().split("#", 1)[1]
    windows, groups = one(r"(\d+) windows in (\d+) groups", comment, "README's induction line")
    assert windows == one(r"heads, (\d+) windows, groups by", EXCERPT, "output")[0]
    assert groups == one(r"over \d+ tests; (\d+) groups;", EXCERPT, "output")[0]


def test_the_induction_heads_the_readme_promises_are_the_output_s():
    """``query roles --run smol --role induction`` on the excerpt: "none" only where the output
    counts no induction head; otherwise the count it names."""
    comment = induction_line().split("#", 1)[1]
    said = one(r"\b(none|one|\d+)\b[^:]*? on the excerpt", comment, "README's induction line")[0]
    count = {"none": 0, "one": 1}.get(said, None)
    assert (int(said) if count is None else count) == decoder_induction(), (
        f"README says {said!r} induction heads on the excerpt; the output counts {decoder_induction()}"
    )


def test_a_claim_that_contradicts_the_output_fails(monkeypatch):
    # the check above is not vacuous: the README's old wording against an output with a head
    module = __import__(__name__, fromlist=["x"])
    monkeypatch.setattr(
        module, "README", "headatlas query roles --run smol --role induction   # none on the excerpt: 57 windows"
    )
    monkeypatch.setattr(module, "decoder_induction", lambda: 1)
    with pytest.raises(AssertionError, match="'none' induction heads"):
        test_the_induction_heads_the_readme_promises_are_the_output_s()
