"""Roles of decoders (SPEC §8, calibrated as §7 says): known answers on hand-made metric rows of a
causal run (induction, duplicate-token and first-token sink; the probe condition; no next-token,
[SEP] sink or broad test, and a family without them), the atlas's codes for the new roles, and
``query roles`` end to end on random:llama with the probe (random weights: no induction head)."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from headatlas.service.storage import run_results

GROUPS = 16  # t with 15 df
LN_N = math.log(125)
CAUSAL = {"short_range_chance": 0.064, "uniform_entropy": LN_N, "causal": True}
BIDIRECTIONAL = {"short_range_chance": 0.064, "uniform_entropy": LN_N}


def iv(value, se):
    """(value, lo, hi) whose 95% interval has jackknife standard error ``se``."""
    from headatlas.service.reports import role_tests

    half = role_tests.interval_quantile(GROUPS) * se
    return value, value - half, value + half


def head(layer, h, probe=None, **metrics):
    """A decoder head's row: every metric at its chance with a tight interval unless given as
    (value, se); ``probe``: (induction_score, duplicate_score), or None (a run without a probe)."""
    chance = {
        "attn_to_prev": 0.035,
        "attn_to_next": 0.035,
        "induction_lift": 1.0,
        "dup_lift": 1.0,
        "repetition_words_lift_dm": 1.0,
        "within_sentence_lift_dm": 1.0,
        "attn_to_punct_lift": 1.0,
        "short_range_share": 0.064,
        "attn_to_cls_lift": 1.0,
        "attn_to_first_lift": 1.0,
        "attn_to_sep_lift": 1.0,
        "attn_entropy": 0.8 * LN_N,  # inside broad's band: a bidirectional run would test it
    }
    row = {"layer": layer, "head": h}
    for name, value in chance.items():
        row[name], row[f"{name}_lo"], row[f"{name}_hi"] = iv(*metrics.get(name, (value, value * 0.01)))
    row["induction_score"], row["duplicate_score"] = probe if probe is not None else (None, None)
    return row


def hand_rows(with_probe: bool):
    """t = (value − threshold) / se, thresholds from service/reports/role_rules.py."""
    from headatlas.service.reports.role_rules import DUP_MIN, FIRST_SINK_MIN, INDUCTION_MIN

    p = (lambda ind, dup: (ind, dup)) if with_probe else (lambda ind, dup: None)
    return [
        head(0, 0, p(0.9, 0.0), induction_lift=(INDUCTION_MIN + 5.0, 0.5)),  # t = 10, probe clears
        head(0, 1, p(0.01, 0.0), induction_lift=(INDUCTION_MIN + 5.0, 0.5)),  # t = 10, probe far under
        head(0, 2, p(0.9, 0.0), induction_lift=(INDUCTION_MIN + 0.2, 0.5)),  # t = 0.4: corpus test fails
        head(1, 0, p(0.0, 0.8), dup_lift=(DUP_MIN + 4.0, 0.4)),  # t = 10
        # the sink; and every metric of the bidirectional-only roles far past its threshold
        head(
            1,
            1,
            p(0.0, 0.0),
            attn_to_first_lift=(FIRST_SINK_MIN + 20.0, 2.0),  # t = 10
            attn_to_cls_lift=(40.0, 1.0),
            attn_to_sep_lift=(40.0, 1.0),
            attn_to_next=(0.9, 0.01),
        ),
        head(1, 2, p(0.0, 0.0), attn_to_prev=(0.9, 0.01)),  # t = 70: previous-token, offered to both
        # t = 20 over the encoders' 1.10, t = −10 against the decoders' 1.25; local far past 3 × chance
        head(2, 0, p(0.0, 0.0), within_sentence_lift_dm=(1.20, 0.005), short_range_share=(0.5, 0.01)),
    ]


def by_head(rows, context, groups=GROUPS):
    from headatlas.service.reports import role_tests

    out: dict[tuple, list[dict]] = {}
    for r in role_tests.assign(rows, context, groups=groups):
        d = dict(zip(role_tests.COLUMNS, r))
        out.setdefault((d["layer"], d["head"]), []).append(d)
    return out


def test_causal_runs_are_offered_the_decoder_roles_only():
    from headatlas.service.reports import role_rules

    assert role_rules.offered_roles(True) == (
        "previous-token",
        "induction",
        "duplicate-token",
        "repetition",
        "sentence-bound",
        "punctuation",
        "first-token sink",
    )
    assert role_rules.offered_roles(False) == (
        "previous-token",
        "next-token",
        "repetition",
        "sentence-bound",
        "punctuation",
        "local",
        "[CLS] sink",
        "[SEP] sink",
        "broad",
    )


def test_decoder_roles_known_answers_with_a_probe():
    from headatlas.service.reports import role_rules, significance

    got = by_head(hand_rows(with_probe=True), CAUSAL)
    assert {k: [d["role"] for d in v] for k, v in got.items()} == {
        (0, 0): ["induction"],
        (0, 1): [role_rules.NONE],  # the corpus test rejects, the probe score (0.01) is under its threshold
        (0, 2): [role_rules.NONE],  # the probe clears, the corpus test does not reject
        (1, 0): ["duplicate-token"],
        (1, 1): ["first-token sink"],  # no [CLS] sink, [SEP] sink, next-token or broad in a causal run
        (1, 2): ["previous-token"],
        (2, 0): [role_rules.NONE],  # random decoders reach 1.2: the causal bound is 1.25; local is not offered
    }
    # 7 heads × 7 offered roles: next-token, local, [CLS] sink, [SEP] sink and broad are not in the family
    assert {d["family"] for v in got.values() for d in v} == {49}
    ind = got[(0, 0)][0]
    assert ind["metric"] == "induction_lift" and ind["threshold"] == role_rules.INDUCTION_MIN
    assert ind["p"] == pytest.approx(significance.t_sf(10.0, 15), rel=1e-9)
    assert ind["probe_score"] == 0.9 and ind["probe_min"] == role_rules.INDUCTION_PROBE_MIN
    assert "induction_score" in ind["rule"]
    dup = got[(1, 0)][0]
    assert dup["probe_score"] == 0.8 and dup["probe_min"] == role_rules.DUP_PROBE_MIN
    sink = got[(1, 1)][0]
    assert sink["metric"] == "attn_to_first_lift" and sink["probe_score"] is None and sink["probe_min"] is None
    assert sink["p"] == pytest.approx(significance.t_sf(10.0, 15), rel=1e-9)
    assert got[(0, 1)][0]["probe_score"] is None  # a head without a role shows no evidence


def test_without_a_probe_the_corpus_test_alone_decides():
    from headatlas.service.reports import role_rules, role_tests

    got = by_head(hand_rows(with_probe=False), CAUSAL)
    assert [d["role"] for d in got[(0, 0)]] == ["induction"]
    assert [d["role"] for d in got[(0, 1)]] == ["induction"]  # nothing to fail: no probe
    assert [d["role"] for d in got[(0, 2)]] == [role_rules.NONE]
    assert got[(0, 1)][0]["probe_score"] is None and got[(0, 1)][0]["probe_min"] is None
    # runs without replicate groups: values tested, the probe still a condition
    values = by_head(hand_rows(with_probe=True), CAUSAL, groups=None)
    assert [d["role"] for d in values[(0, 1)]] == [role_rules.NONE]
    assert [d["role"] for d in values[(0, 2)]] == ["induction"]  # 3.2 ≥ 3: the value holds
    assert values[(0, 2)][0]["test"] == role_tests.VALUE_TEST


def test_the_same_rows_in_a_bidirectional_run_get_the_encoder_roles():
    """The decoder roles are not offered; next-token, local, [CLS] sink, [SEP] sink and broad are."""
    from headatlas.service.reports import role_rules

    got = by_head(hand_rows(with_probe=True), BIDIRECTIONAL)
    assert [d["role"] for d in got[(0, 0)]] == ["broad"]
    assert [d["role"] for d in got[(1, 1)]] == ["next-token", "[CLS] sink", "[SEP] sink", "broad"]
    assert [d["role"] for d in got[(2, 0)]] == ["sentence-bound", "local", "broad"]
    assert got[(2, 0)][0]["threshold"] == role_rules.SENTENCE_MIN
    assert {d["family"] for v in got.values() for d in v} == {63}  # 7 heads × 9 roles


def test_a_run_is_causal_when_no_row_sees_its_next_token(tmp_path):
    """next_rows sums to 0: causal; NULL (runs stored before it, all bidirectional) or > 0: not."""
    from sqlalchemy import text

    from headatlas.service.reports import attention_kind
    from headatlas.service.storage.db import transaction
    from headatlas.service.storage.store import Store
    from tests.test_role_stability import hand_run

    path = tmp_path / "hand.duckdb"
    run = hand_run(path)
    with Store(path).checked_read() as conn:
        assert attention_kind.causal_run(conn, run) is False  # next_rows NULL
        assert attention_kind.causal_run(conn, 999) is False  # no such run
    for value, causal in ((0, True), (5, False)):
        with transaction(path) as conn:
            conn.execute(text("UPDATE run_chance SET next_rows = :v WHERE run_id = :r"), {"v": value, "r": run})
        with Store(path).checked_read() as conn:
            assert attention_kind.causal_run(conn, run) is causal


def test_atlas_codes_the_decoder_roles_and_lists_the_offered_ones():
    from headatlas.service.reports import atlas_plots, role_rules, role_tests

    filler = [None] * (len(role_tests.COLUMNS) - 4)
    rows = [
        (0, 0, "induction", True, *filler),
        (0, 1, "duplicate-token", True, *filler),
        (1, 0, "first-token sink", True, *filler),
        (1, 1, role_rules.NONE, True, *filler),
    ]
    fig, index = atlas_plots.figure_atlas(
        list(role_tests.COLUMNS), rows, n_layers=2, n_heads=2, title="decoder", offered=role_rules.offered_roles(True)
    )
    texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in fig.axes[0].texts}
    assert texts == {(0, 0): "induction", (0, 1): "duplicate", (1, 0): "first sink"}
    assert index[0, 0] == atlas_plots.ATLAS_ROLES.index("induction")
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "induction (1)" in legend and "first-token sink (1)" in legend
    assert not [t for t in legend if "next-token" in t or "[SEP]" in t or "[CLS]" in t or "broad" in t]


# --- end to end: random:llama with the probe -----------------------------------------------------
def invoke(*args: str) -> str:
    from headatlas.cli.main import app

    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "300", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_query_roles_on_a_random_decoder_with_the_probe(tmp_path, small_corpus, monkeypatch):
    """Random weights hold no induction head: the probe scores sit near uniform attention and the
    corpus lift near 1. The same run with the thresholds lowered to nothing earns induction on
    every head that has a value, so the rule does reach these rows; and a probe threshold no score
    reaches takes it away again (the probe condition end to end)."""
    from headatlas.service.reports import role_rules

    db = tmp_path / "dec.duckdb"
    common = ("analyze", str(small_corpus), "--db", str(db), "-m", "random:llama", "--device", "cpu", "-q")
    assert invoke(*common, "--seq-len", "64", "--probe", "--probe-length", "20", "--probe-sequences", "4").split() == [
        "1"
    ]
    heads = json.loads(invoke("query", "heads", "--db", str(db), "--run", "1", "--format", "json"))
    n_heads = len(heads)
    assert n_heads == 8 and all(h["induction_score"] is not None for h in heads)
    # a decoder's tables show BOS (attn_to_first), not [CLS]/[SEP]/next-token columns it has no use for
    encoder_only = ("attn_to_cls", "attn_to_sep", "attn_to_next")
    layers = json.loads(invoke("query", "layers", "--db", str(db), "--run", "1", "--ci", "--format", "json"))
    bounds = json.loads(invoke("query", "boundaries", "--db", str(db), "--run", "1", "--format", "json"))
    for row in (heads[0], layers[0], bounds[0]):
        assert not [k for k in row if k.startswith(encoder_only)], sorted(row)
        assert row["attn_to_first_lift"] is not None
    assert "attn_to_first_lift_lo" in layers[0]
    table = invoke("query", "layers", "--db", str(db), "--run", "1")
    assert "attn_to_first_lift" in table and "attn_to_cls" not in table
    assert max(h["induction_score"] for h in heads) < role_rules.INDUCTION_PROBE_MIN

    rows = json.loads(invoke("query", "roles", "--db", str(db), "--run", "1", "--format", "json"))
    assert "induction" not in {r["role"] for r in rows}
    # the family: the causal run's offered roles only (7 per head, every value defined)
    assert {r["family"] for r in rows} == {7 * n_heads}
    table = invoke("query", "roles", "--db", str(db), "--run", "1", "--stability")
    counts = next(line for line in table.splitlines() if line.startswith("heads per role:"))
    assert "induction 0" in counts and "first-token sink" in counts and "duplicate-token" in counts
    for absent in ("next-token", "[SEP] sink", "[CLS] sink", "broad", "local"):
        assert absent not in counts
    assert "probe_score" in " ".join(table.split())  # the note says how the probe enters

    # the report has a probe section: the top heads of each score, as query heads has them
    page = tmp_path / "report.html"
    invoke("report", "1", "--db", str(db), "--out", str(page))
    html = page.read_text(encoding="utf-8")
    top = max(heads, key=lambda h: h["induction_score"])
    assert "<h2>Induction probe</h2>" in html and "Top 8 heads by induction_score" in html
    section = html[html.index("<h2>Induction probe</h2>") : html.index("Top 8 heads by duplicate_score")]
    assert f"<td>{top['layer']}</td><td>{top['head']}</td>" in section.replace("\n", "")

    # --layer, --head, --role choose rows; the tests (family, p_holm) stay the whole run's
    base = ("query", "roles", "--db", str(db), "--run", "1", "--format", "json")
    one = json.loads(invoke(*base, "--layer", "1", "--head", "2"))
    assert one == [r for r in rows if (r["layer"], r["head"]) == (1, 2)] and one
    layer = json.loads(invoke(*base, "--layer", "0"))
    assert layer == [r for r in rows if r["layer"] == 0] and {r["head"] for r in layer} == {0, 1, 2, 3}
    none = json.loads(invoke(*base, "--role", "none"))
    assert none == [r for r in rows if r["role"] == role_rules.NONE]
    assert json.loads(invoke(*base, "--role", "Induction")) == []  # offered, held by no head here
    filtered = invoke("query", "roles", "--db", str(db), "--run", "1", "--layer", "1")
    assert f"4 of its {len(rows)} rows (--layer 1)" in " ".join(filtered.split())
    assert f"none established {n_heads}" in filtered  # the counts are the whole run's
    from headatlas.cli.main import app

    for bad, said in (
        (("--role", "inducton"), "--role 'inducton': not a role; did you mean 'induction'"),
        (("--role", "[CLS] sink"), "--role '[CLS] sink': not a role run 1"),
        (("--layer", "2"), "--layer 2: run 1 has layers 0..1"),
        (("--head", "4"), "--head 4: run 1 has heads 0..3"),
    ):
        refused = CliRunner().invoke(
            app, ["query", "roles", "--db", str(db), "--run", "1", *bad], env={"COLUMNS": "300"}
        )
        assert refused.exit_code == 2 and said in refused.stderr and len(refused.stderr.strip().splitlines()) == 1

    lowered = [
        role_rules.Rule(r.role, r.metric, r.side, lambda c: 0.0, r.rule, r.kinds, r.probe, 0.0)
        if r.role == "induction"
        else r
        for r in role_rules.RULES
    ]
    monkeypatch.setattr(role_rules, "RULES", tuple(lowered))
    # the run's roles were stored when it finished, under the rules of the code: with rules changed
    # in the process they are derived again (the stored results' key names the code, not a patch)
    with run_results.computed():
        rows = json.loads(invoke("query", "roles", "--db", str(db), "--run", "1", "--format", "json"))
    induction = [r for r in rows if r["role"] == "induction"]
    assert len(induction) == n_heads and all(0.0 < r["probe_score"] < 1.0 for r in induction)

    unreachable = [
        role_rules.Rule(r.role, r.metric, r.side, lambda c: 0.0, r.rule, r.kinds, r.probe, 1.01)
        if r.role == "induction"
        else r
        for r in role_rules.RULES
    ]
    monkeypatch.setattr(role_rules, "RULES", tuple(unreachable))
    with run_results.computed():
        rows = json.loads(invoke("query", "roles", "--db", str(db), "--run", "1", "--format", "json"))
    assert "induction" not in {r["role"] for r in rows}
