"""A column the run does not hold is refused, not shown blank: `query heads --sort/--columns` of an
effect the run was analysed without says so and how to get it (as a probe score without a probe
always was); and `prune`'s table fits 100 columns, the rest in --format csv/json."""

from __future__ import annotations

import json

import pytest
from conftest import invoke_cli

TINY = ["--model", "random:tiny", "--batch-size", "8"]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, demo_corpus) -> str:
    """A run analysed without effects or a probe (random:tiny, two documents): its database."""
    folder = tmp_path_factory.mktemp("blanks")
    corpus = folder / "c.txt"
    docs = demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]
    corpus.write_text("\n\n".join(d.strip() for d in docs) + "\n", encoding="utf-8")
    db = str(folder / "plain.duckdb")
    done = invoke_cli("analyze", str(corpus), "--name", "plain", "--db", db, "--quiet", *TINY)
    assert done.returncode == 0, done.stderr
    return db


def _one_error(result) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert result.stdout == ""  # no blank table before it
    return lines[0]


@pytest.mark.parametrize(
    ("column", "kind"),
    [("effect_zero", "zero"), ("effect_mean", "mean"), ("drift_zero", "zero"), ("importance", "gradient")],
)
def test_sort_by_an_effect_the_run_did_not_measure_is_refused(plain_run, cli, column, kind) -> None:
    line = _one_error(cli("query", "heads", "--run", "plain", "--db", plain_run, "--sort", column))
    assert f"--sort {column}: run 1 holds no {column}" in line, line
    assert f"analysed without --effects {kind}" in line and f"again with --effects {kind}" in line, line
    assert "`headatlas effects CORPUS`" in line, line


def test_columns_naming_an_effect_or_probe_score_the_run_lacks_is_refused(plain_run, cli) -> None:
    effect = _one_error(cli("query", "heads", "--run", "plain", "--db", plain_run, "--columns", "layer,effect_mean"))
    assert "--columns effect_mean: run 1 holds no effect_mean" in effect and "--effects mean" in effect, effect
    probe = _one_error(cli("query", "heads", "--run", "plain", "--db", plain_run, "--columns", "induction_score"))
    assert "run 1 has no probe" in probe and "--probe" in probe, probe
    # every format: a CSV of a blank column is as silent as a table
    csv = _one_error(
        cli("query", "heads", "--run", "plain", "--db", plain_run, "--columns", "effect_zero", "--format", "csv")
    )
    assert "holds no effect_zero" in csv
    # what the run holds is shown as before
    held = cli("query", "heads", "--run", "plain", "--db", plain_run, "--columns", "layer,head,noise_share")
    assert held.returncode == 0 and "noise_share" in held.stdout, held.stderr


def test_the_python_api_refuses_the_same_sort_in_its_own_terms(plain_run) -> None:
    import headatlas

    run = headatlas.connect(plain_run).run("plain")
    with pytest.raises(ValueError, match="run 1 holds no importance") as refused:
        run.heads(sort="importance")
    assert "effects='gradient'" in str(refused.value) and "headatlas.effects(corpus)" in str(refused.value)


def _widest(out: str) -> int:
    return max(len(line) for line in out.splitlines())


def test_prune_table_fits_100_columns_and_json_keeps_every_column(plain_run, cli) -> None:
    """... and a prune leaves the run's stored results current: the SQL `roles` view (which reads
    them) keeps every head after it, with no `db upgrade` (its curves were in the fingerprint of
    what the results are derived from, which they are not)."""
    roles_sql = ["sql", "SELECT count(DISTINCT (layer, head)) AS n FROM roles", "--db", plain_run, "--format", "json"]
    before = json.loads(cli(*roles_sql).stdout)[0]["n"]
    assert before == 2 * 4
    measured = cli(
        "prune", "plain", "--db", plain_run, "--windows", "2", "--step", "50%", "--seeds", "1", "--format", "json"
    )
    assert measured.returncode == 0, measured.stderr
    rows = json.loads(measured.stdout)
    every = list(rows[0])
    assert {"fraction", "objective_lo", "objective_hi", "increase_lo", "increase_hi"} <= set(every)
    for columns in ("", "100"):  # piped with no width given, and a 100-column terminal
        shown = cli("prune", "plain", "--db", plain_run, "--show", env={"COLUMNS": columns, "NO_COLOR": "1"})
        assert shown.returncode == 0, shown.stderr
        assert _widest(shown.stdout) <= 100, shown.stdout
        header = shown.stdout.splitlines()[1].split()
        assert header[:3] == ["order", "step", "heads_removed"] and "increase" in header, header
        assert "--format csv or json" in " ".join(shown.stdout.split()), shown.stdout  # where the rest is
    csv = cli("prune", "plain", "--db", plain_run, "--show", "--format", "csv")
    assert csv.stdout.splitlines()[0].split(",") == every
    assert json.loads(cli(*roles_sql).stdout)[0]["n"] == before


def test_the_web_refuses_the_same_sort_in_its_own_words(plain_run, cli) -> None:
    """serve's head table sorted by an effect the run lacks: a 400 page with the check the command
    line makes (queries.heads, for every front end), worded for the address (``?sort=``), not a
    blank column."""
    from web_support import Client

    from headatlas.service.web.app import WebApp

    said = _one_error(cli("query", "heads", "--run", "plain", "--db", plain_run, "--sort", "effect_zero"))
    answer = Client(WebApp(plain_run)).get("/runs/plain?sort=effect_zero")
    assert answer.status == 400, answer.status
    assert "holds no effect_zero" in answer.text and "--effects zero" in answer.text, answer.text[-2000:]
    assert said.removeprefix("error: ").split(":")[0] == "--sort effect_zero"
    assert "?sort=effect_zero: run 1 holds no effect_zero" in answer.text, answer.text[-2000:]
    assert Client(WebApp(plain_run)).get("/runs/plain?sort=noise_share").status == 200


def test_effects_in_one_replicate_group_print_no_nan_and_say_why(tiny_model, small_corpus, tmp_path, cli) -> None:
    """Effects on a run's first two windows (one document's first block: one replicate group, as
    runs stored before effect windows were spread over the groups took them) have no interval, as
    the jackknife needs two groups: `query roles`, `query heads --ci` and the report say so in
    words and print no NaN bounds, nor a heading promising 95% intervals."""
    import re

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.reports.effect_report import effects_section
    from headatlas.service.storage.store import Store

    db = tmp_path / "one.duckdb"
    params = build_params(seq_len=32, effects="zero,mean", effect_windows=2, effect_reference=2, effect_spread="first")
    analyze_corpus(
        str(small_corpus), store=Store(db), model=tiny_model, params=params, corpus=survey_corpus(str(small_corpus))
    )
    roles = cli("query", "roles", "--db", str(db))
    heads = cli("query", "heads", "--db", str(db), "--ci", "--columns", "layer,head,effect_mean,effect_zero")
    for result in (roles, heads):
        assert result.returncode == 0, result.stderr
    with Store(db).read() as conn:  # the report's section of effects, as `headatlas report` renders it
        page = effects_section(conn, Store(db).get_run(1), table=lambda c, r: f"{c}{r}", img=lambda *_: "")
    for shown in (roles.stdout, heads.stdout, page):
        assert not re.search(r"\bnan\b|\[–, –\]", shown, re.IGNORECASE), shown
    said = "no intervals: these windows fall in 1 replicate group, and an interval needs 2 or more"
    assert said in roles.stdout and said in page
    assert "mean effect of each role's heads (primary role):" in roles.stdout
    assert "is largest, with 95% intervals" not in page
