"""Runs by name (aliases, rename, delete, tags), the default run, `sql --run`, tables that fit the
terminal, and help that reads as text — in-process through typer's CliRunner, on `random:tiny`
runs of real text stored in a real DuckDB file."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys

import duckdb
import pytest
import typer.main
from typer.testing import CliRunner

from headatlas.cli.main import app
from headatlas.cli.reference import command_paths

TINY = ["--model", "random:tiny", "--batch-size", "8"]


def invoke(*args: str, input: str | None = None, columns: int | None = 100):
    """``columns``: $COLUMNS, the width the output fits (None: unset, as in a pipe)."""
    env = {"COLUMNS": "" if columns is None else str(columns), "NO_COLOR": "1"}
    return CliRunner().invoke(app, list(args), input=input, env=env)


def ok(*args: str, **kwargs):
    result = invoke(*args, **kwargs)
    assert result.exit_code == 0, (args, result.stdout, result.stderr)
    return result


def one_error_line(result, *words: str) -> str:
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


def runs(db) -> list[dict]:
    return json.loads(ok("runs", "--db", str(db), "--format", "json").stdout)


def count(db, sql: str) -> int:
    with duckdb.connect(str(db), read_only=True) as conn:
        return conn.execute(sql).fetchone()[0]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, demo_corpus):
    root = tmp_path_factory.mktemp("cli-runs")
    docs = demo_corpus.read_text(encoding="utf-8").split("\n\n")
    a, b = root / "a.txt", root / "b.txt"
    a.write_text("\n\n".join(d.strip() for d in docs[:2]) + "\n", encoding="utf-8")
    b.write_text("\n\n".join(d.strip() for d in docs[2:3]) + "\n", encoding="utf-8")
    return root, a, b


@pytest.fixture(scope="module")
def atlas(corpora):
    """mine (corpus a), wiki (the same analysis asked for again, with a control), other (corpus b)."""
    root, a, b = corpora
    db = root / "atlas.duckdb"
    ok("analyze", str(a), "--name", "mine", "--db", str(db), "--quiet", *TINY)
    again = ok("analyze", str(a), "--name", "wiki", "--control", "--db", str(db), *TINY)
    ok("analyze", str(b), "--name", "other", "--db", str(db), "--quiet", *TINY)
    return db, again


def test_a_name_asked_for_an_identical_analysis_becomes_its_alias(atlas):
    db, again = atlas
    assert "run 1 (mine) holds this corpus, model and parameters already" in again.stderr
    assert "'wiki' now names it too" in again.stderr
    stored = {r["name"]: r for r in runs(db)}
    assert set(stored) == {"mine", "wiki-control", "other"}  # nothing was analysed twice
    assert stored["mine"]["aliases"] == ["wiki"]
    assert stored["wiki-control"]["windows"] == stored["mine"]["windows"]
    # the alias names the run wherever a run is named
    assert ok("query", "layers", "--run", "wiki", "--db", str(db)).stdout.startswith("run 1 (mine): layers")
    compared = ok("compare", "wiki", "--db", str(db))
    assert "A = run 1 (mine" in compared.stdout and "wiki-control" in compared.stdout
    assert "run 1 (mine): head roles" in ok("query", "roles", "--run", "wiki", "--db", str(db)).stdout


@pytest.mark.parametrize(
    "name,words",
    [
        ("42", ["run id", "run-42"]),
        ("two\nlines", ["control character"]),
        ("tab\there", ["control character"]),
        ("report\u202efdp.exe", ["U+202E", "RIGHT-TO-LEFT OVERRIDE", "reorders"]),
        ("a\u2066b", ["U+2066", "reorders"]),
        ("zero\u200bwidth", ["U+200B", "ZERO WIDTH SPACE", "invisible"]),
        ("zw\u200cnj", ["U+200C"]),
        ("zw\u200dj", ["U+200D"]),
        ("word\u2060joiner", ["U+2060"]),
        ("\ufeffbom", ["U+FEFF"]),
    ],
)
def test_names_that_are_ids_or_hold_control_characters_are_refused(atlas, corpora, name, words):
    db, _ = atlas
    before = runs(db)
    one_error_line(invoke("analyze", str(corpora[1]), "--name", name, "--db", str(db), *TINY), *words)
    one_error_line(invoke("runs", "rename", "mine", name, "--db", str(db)), *words)
    assert runs(db) == before


def test_a_name_taken_by_another_run_is_refused(atlas, corpora):
    db, _ = atlas
    one_error_line(invoke("runs", "rename", "other", "wiki", "--db", str(db)), "taken by run 1")
    # corpus b is stored as "other": the name asked for is taken by run 1 (corpus a)
    taken = invoke("analyze", str(corpora[2]), "--name", "mine", "--quiet", "--db", str(db), *TINY)
    one_error_line(taken, "taken by run 1", "run 3 (other) already holds")


def test_rename_tag_and_delete(atlas, tmp_path):
    db = tmp_path / "copy.duckdb"
    shutil.copy(atlas[0], db)
    done = ok("runs", "rename", "wiki", "base", "--db", str(db))  # by alias: the run it names
    assert "'mine' → 'base'" in done.stdout
    one_error_line(invoke("query", "layers", "--run", "mine", "--db", str(db)), "no run 'mine'")
    ok("query", "layers", "--run", "wiki", "--db", str(db))
    ok("runs", "tag", "base", "baseline", "q4", "--db", str(db))
    ok("runs", "tag", "other", "baseline", "--db", str(db))
    ok("runs", "tag", "base", "--remove", "q4", "--db", str(db))
    tagged = json.loads(ok("runs", "--tag", "baseline", "--db", str(db), "--format", "json").stdout)
    assert [(r["name"], r["tags"]) for r in tagged] == [("base", ["baseline"]), ("other", ["baseline"])]

    other = next(r["run_id"] for r in runs(db) if r["name"] == "other")
    kept = count(db, "SELECT count(*) FROM head_stats WHERE run_id <> " + str(other))
    assert count(db, f"SELECT count(*) FROM head_stats WHERE run_id = {other}") > 0
    refused = invoke("runs", "delete", "other", "--db", str(db), input="n\n")
    assert refused.exit_code == 1 and "nothing deleted" in refused.stderr
    assert "other" in {r["name"] for r in runs(db)}
    deleted = ok("runs", "delete", "other", "--db", str(db), input="y\n")
    assert "deleted run" in deleted.stdout
    assert "other" not in {r["name"] for r in runs(db)}
    for table in ("head_stats", "run_windows", "dist_hist", "anchors", "run_tags", "batches", "runs"):
        assert count(db, f"SELECT count(*) FROM {table} WHERE run_id = {other}") == 0, table
    assert count(db, f"SELECT count(*) FROM head_stats WHERE run_id <> {other}") == kept
    # its windows went with it; the other runs' windows stay
    assert count(db, "SELECT count(*) FROM windows WHERE window_id NOT IN (SELECT window_id FROM run_windows)") == 0
    assert count(db, "SELECT count(*) FROM windows") == count(db, "SELECT count(DISTINCT window_id) FROM run_windows")
    # a run's controls stay unless named; --yes asks nothing
    done = ok("runs", "delete", "base", "--yes", "--db", str(db))
    assert "controls stay" in done.stderr
    assert [r["name"] for r in runs(db)] == ["wiki-control"]


def test_the_default_run_passes_over_one_in_progress_with_a_note(atlas, tmp_path):
    db = tmp_path / "copy.duckdb"
    shutil.copy(atlas[0], db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE runs SET status = 'running' WHERE name = 'other'")
    shown = ok("query", "layers", "--db", str(db))
    assert "run 1 (mine): layers" in shown.stdout  # the latest finished run that is no control
    assert "note: run 3 (other) is running; showing the latest finished run, 1 (mine)" in shown.stderr
    asked = ok("query", "layers", "--run", "other", "--db", str(db))
    assert "note: run 3 (other) is in progress: results so far" in asked.stderr
    with duckdb.connect(str(db)) as conn:
        conn.execute("UPDATE runs SET status = 'running'")
    alone = ok("query", "heads", "--db", str(db))
    assert "run 3 (other): heads" in alone.stdout and "is in progress" in alone.stderr
    one_error_line(invoke("runs", "delete", "other", "--yes", "--db", str(db)), "--force")


def test_sql_run_scopes_every_view_and_table_to_one_run(atlas):
    db, _ = atlas
    every = json.loads(
        ok("sql", "SELECT count(DISTINCT run_id) AS n FROM head_metrics", "--db", str(db), "--format", "json").stdout
    )
    assert every == [{"n": 3}]
    for relation in ("head_metrics", "layer_metrics", "head_stats", "runs", "run_windows"):
        scoped = ok(
            "sql", f"SELECT DISTINCT run_id FROM {relation}", "--run", "wiki", "--db", str(db), "--format", "csv"
        )
        assert scoped.stdout.split() == ["run_id", "1"], relation
    mixed = ok("sql", "SELECT layer, head, noise_share FROM head_metrics LIMIT 3", "--db", str(db))
    assert "note: the database holds 3 runs" in mixed.stderr
    one_error_line(invoke("sql", "SELECT 1", "--run", "nope", "--db", str(db)), "no run 'nope'")


def temp_views(cursor) -> int:
    return cursor.execute("SELECT count(*) FROM duckdb_views() WHERE temporary AND NOT internal").fetchone()[0]


def test_sql_run_shadows_the_names_a_statement_reaches_and_reads_what_shadowing_all_reads(atlas, tmp_path):
    """`sql --run` shadows only the names a statement can reach (its words and, through the views'
    definitions, theirs): every view, the run-less tables and a few compound statements read the
    same rows as with every name shadowed, and a statement that lists the catalogue still sees
    every shadow. Shadowing all plans the whole view chain (about 0.1 s per query). A view that
    reads across runs (here one added to a copy, as a plugin's might be) shows why the views'
    own names count: its ``runs`` is the shadow too."""
    from headatlas.service.storage.readonly import scope_to_run

    db = tmp_path / "copy.duckdb"
    shutil.copy(atlas[0], db)
    with duckdb.connect(str(db)) as conn:
        conn.execute("CREATE VIEW run_share AS SELECT run_id, 1 / count(*) OVER () AS share FROM runs")
    run = count(db, "SELECT run_id FROM runs WHERE name = 'other'")
    listing = "SELECT table_name, table_type FROM information_schema.tables"
    # one thread: a float sum's order, and so its last bits, is then the plan's alone
    with duckdb.connect(str(db), read_only=True, config={"threads": 1}) as conn:
        views = [
            r[0] for r in conn.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall()
        ]
        shadow_all = conn.cursor()
        scope_to_run(shadow_all, run)
        everything = temp_views(shadow_all)
        statements = [f"SELECT * FROM {name}" for name in [*views, "windows", "documents", "runs", "run_windows"]] + [
            "SELECT (SELECT count(*) FROM windows), (SELECT count(*) FROM documents), (SELECT max(layer) FROM head_stats)",
            "WITH h AS (SELECT * FROM head_metrics) SELECT h.layer, h.head, r.name FROM h JOIN runs r USING (run_id)",
            listing,
            "SHOW TABLES",
            "DESCRIBE head_metrics",
            "SELECT 1",
        ]
        shadowed = {}
        for statement in statements:
            scoped = conn.cursor()
            scope_to_run(scoped, run, statement)
            expected = sorted(map(repr, shadow_all.execute(statement).fetchall()))
            assert sorted(map(repr, scoped.execute(statement).fetchall())) == expected, statement
            shadowed[statement] = temp_views(scoped)
            scoped.close()
    assert everything > 40
    assert shadowed["SELECT 1"] == 0 and shadowed["SELECT * FROM runs"] == 1
    assert 0 < shadowed["SELECT * FROM head_metrics"] < everything
    assert count(db, "SELECT max(share) FROM run_share") < 1  # three runs, one shadowed
    assert shadowed["SHOW TABLES"] == shadowed[listing] == everything


def test_sql_help_names_every_table_and_view_of_a_new_database(tmp_path):
    from headatlas.service.storage import relations
    from headatlas.service.storage.db import upgrade

    db = tmp_path / "new.duckdb"
    upgrade(db)
    with duckdb.connect(str(db), read_only=True) as conn:
        found = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    listed = {*relations.TABLES, *relations.VIEWS, *relations.REP_VIEWS}
    assert found - {"alembic_version"} == listed
    text = " ".join(ok("sql", "--help", columns=200).stdout.split())
    for name in listed:
        assert re.search(rf"\b{name}\b", text), name


def _header(output: str) -> list[str]:
    lines = output.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("─"))
    return lines[rule - 1].split()


def test_tables_fit_the_terminal_and_never_break_a_header(atlas):
    db, _ = atlas
    from headatlas.cli.query_commands import HEAD_TABLE, LAYER_TABLE

    for args, default in ((["query", "heads"], HEAD_TABLE), (["query", "layers"], LAYER_TABLE)):
        out = ok(*args, "--run", "mine", "--db", str(db)).stdout
        assert all(len(line) <= 100 for line in out.splitlines()), out
        assert _header(out) == default
    for args in (["runs"], ["metrics"], ["query", "roles", "--run", "mine"], ["compare", "mine"]):
        out = ok(*args, "--db", str(db)).stdout if args != ["metrics"] else ok(*args).stdout
        assert all(len(line) <= 100 for line in out.splitlines()), (args, out)
    # narrower: columns are left out from the right, and the line under the table names them
    narrow = ok("query", "heads", "--run", "mine", "--db", str(db), columns=60).stdout
    assert all(len(line) <= 60 for line in narrow.splitlines() if not line.startswith(("lift", "chance", "left")))
    shown = _header(narrow)
    assert shown == HEAD_TABLE[: len(shown)] and len(shown) < len(HEAD_TABLE)
    assert f"left out to fit 60 characters: {', '.join(HEAD_TABLE[len(shown) :])}" in " ".join(narrow.split())
    # piped, with no width given: every default column, and each note on one line of its own
    piped = ok("query", "heads", "--run", "mine", "--ci", "--db", str(db), columns=None).stdout
    assert _header(piped) == HEAD_TABLE
    assert any(
        line.startswith("lift = share / chance;") and line.endswith("above that chance.") for line in piped.splitlines()
    )


def _fits(out: str, width: int = 100) -> None:
    assert all(len(line) <= width for line in out.splitlines()), out


def test_each_command_shows_its_answer_in_100_columns(atlas, tmp_path):
    """A 100-column terminal: compare shows both values, the difference and the verdict (not
    one run's value with its interval), query roles --stability each half and stable, query
    boundaries the distance-matched lift, schedule list the next fire whole; every line fits."""
    db, _ = atlas
    compared = ok("compare", "mine", "--db", str(db)).stdout
    _fits(compared)
    assert _header(compared) == ["layer_a", "metric", "value_a", "value_b", "difference", "verdict"]
    rows = [line.split() for line in compared.splitlines() if re.match(r"\d+ {2,}[a-z_]+ {2,}[-\d]", line)]
    verdicts = ("beyond", "within", "no interval", "no value")
    assert rows and all(" ".join(row).endswith(verdicts) for row in rows), compared
    heads = ok("compare", "mine", "--heads", "--db", str(db)).stdout
    _fits(heads)
    assert _header(heads)[:2] == ["layer_a", "head"] and _header(heads)[-1] == "verdict"
    stability = ok("query", "roles", "--run", "mine", "--stability", "--db", str(db)).stdout
    _fits(stability)
    assert _header(stability)[:3] == ["layer", "head", "role"]
    assert _header(stability)[-3:] == ["half_a", "half_b", "stable"]
    boundaries = ok("query", "boundaries", "--run", "mine", "--ci", "--db", str(db)).stdout
    _fits(boundaries)
    assert _header(boundaries)[:2] == ["layer", "within_sentence_lift_dm"]
    corpus = tmp_path / "a folder with a rather long name for its corpus" / "incoming.txt"
    corpus.parent.mkdir()
    corpus.write_text("One sentence. Another one.\n", encoding="utf-8")
    ok("schedule", "add", "nightly", "--corpus", str(corpus), "--cron", "0 3 * * *", "--db", str(db), *TINY)
    listed = ok("schedule", "list", "--db", str(db)).stdout
    _fits(listed)
    assert _header(listed)[:4] == ["name", "state", "when", "next_fire_utc"]
    assert re.search(r"nightly .* \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", listed)  # the timestamp on one line
    assert str(corpus) in " ".join(ok("schedule", "list", "--wide", "--db", str(db)).stdout.split())
    _fits(ok("schedule", "show", "nightly", "--db", str(db)).stdout)
    ok("schedule", "remove", "nightly", "--db", str(db))


def test_models_and_sql_fit_100_columns_with_names_whole(atlas):
    """`models` keeps every model's name and hub id on one line; `sql` fits the width as the other
    tables do, leaving columns out from the right with a line that names them."""
    db, _ = atlas
    listed = ok("models").stdout
    _fits(listed)
    lines = listed.splitlines()
    for row in json.loads(ok("models", "--format", "json").stdout):
        whole = row["what"].split()[0] if row["kind"] == "named" else row["model"]
        if row["kind"] != "family":
            assert any(whole in line for line in lines), (whole, listed)
    selected = ok("sql", "SELECT * FROM head_metrics ORDER BY layer, head", "--run", "mine", "--db", str(db)).stdout
    _fits(selected)
    assert _header(selected)[:3] == ["run_id", "layer", "head"]
    said = " ".join(selected.split())
    assert "left out to fit 100 characters: " in said and "--format csv|json for every column" in said
    few = ok("sql", "SELECT layer, head FROM head_metrics", "--run", "mine", "--db", str(db)).stdout
    assert _header(few) == ["layer", "head"] and "left out" not in few


def test_query_roles_keeps_the_role_its_effect_and_the_halves(tmp_path, corpora):
    """Where the roles table does not fit, the evidence yields first: the role, its value and the
    head's effect stay, and with --stability whether the role held on each half."""
    _, a, _ = corpora
    db = tmp_path / "roles.duckdb"
    ok("analyze", str(a), "--name", "fx", "--db", str(db), "--quiet", *TINY)
    ok("effects", "fx", "--windows", "4", "--db", str(db))
    default = ok("query", "roles", "--run", "fx", "--db", str(db), columns=70).stdout
    _fits(default, 70)
    assert {"role", "value", "effect"} <= set(_header(default)), default
    stability = ok("query", "roles", "--run", "fx", "--stability", "--db", str(db), columns=70).stdout
    _fits(stability, 70)
    assert {"role", "half_a", "half_b", "stable"} <= set(_header(stability)), stability


def test_compare_says_a_decoders_cls_column_is_its_first_token(atlas, corpora, tmp_path):
    """A causal model has no [CLS]: where compare lists attn_to_cls_lift for one, a note says the
    column means the first token there; an encoder's comparison has no such note."""
    _, a, _ = corpora
    db = tmp_path / "decoder.duckdb"
    ok("analyze", str(a), "--name", "dec", "--control", "--db", str(db), "--quiet", "--model", "random:gpt2")
    decoder = " ".join(ok("compare", "dec", "--db", str(db)).stdout.split())
    assert "attn_to_cls_lift" in decoder
    assert (
        "attn_to_cls_lift: for a causal model (run 1 (dec), run 2 (dec-control)) the [CLS] column means the first token"
        in decoder
    )
    encoder_db, _ = atlas
    assert "causal model" not in ok("compare", "wiki", "--db", str(encoder_db)).stdout
    # the web's comparison says it too
    from web_support import Client

    from headatlas.service.web.app import WebApp

    page = Client(WebApp(str(db))).get("/compare/1/2")
    assert page.status == 200 and "for a causal model (run 1 (dec), run 2 (dec-control))" in page.text


def test_columns_picks_and_wide_shows_all(atlas):
    db, _ = atlas
    picked = ok("query", "heads", "--run", "mine", "--columns", "layer,head,attn_entropy", "--db", str(db))
    assert _header(picked.stdout) == ["layer", "head", "attn_entropy"]
    csv = ok("query", "heads", "--run", "mine", "--columns", "head,layer", "--format", "csv", "--ci", "--db", str(db))
    assert csv.stdout.splitlines()[0] == "head,layer,interval_by"
    wide = _header(ok("query", "heads", "--run", "mine", "--wide", "--db", str(db)).stdout)
    every = json.loads(ok("query", "heads", "--run", "mine", "--format", "json", "--db", str(db)).stdout)[0]
    assert wide == list(every)
    line = one_error_line(invoke("query", "heads", "--columns", "layer,nope", "--db", str(db)), "--columns nope")
    assert "choose from layer, head," in line and "attn_entropy" in line


def test_sort_names_its_metrics_and_sorts_both_ways(atlas):
    db, _ = atlas
    from headatlas.service.reports.columns import SORTABLE

    # a mistyped name is told the closest ones and where the list is, not the whole list
    line = one_error_line(
        invoke("query", "heads", "--sort", "mean_distanse", "--db", str(db)), "--sort 'mean_distanse'"
    )
    assert "did you mean mean_distance" in line and "`headatlas metrics`" in line and len(line) < 200
    help_text = " ".join(ok("query", "heads", "--help", columns=200).stdout.split())
    assert all(name in help_text for name in SORTABLE) and "--asc" in help_text

    def order(*extra):
        args = ("query", "heads", "--run", "mine", "--sort", "mean_distance", "--format", "json", "--db", str(db))
        return [r["mean_distance"] for r in json.loads(ok(*args, *extra).stdout)]

    assert order() == sorted(order(), reverse=True)
    assert order("--asc") == sorted(order())
    one_error_line(invoke("query", "heads", "--asc", "--db", str(db)), "--sort")


def test_help_shows_value_names_not_types_and_keeps_sentences_whole():
    paths = [(), *(p for p, _ in command_paths(typer.main.get_command(app)))]
    assert len(paths) > 30
    assert ok("query", "heads", "-h").stdout == ok("query", "heads", "--help").stdout
    for path in paths:
        out = ok(*path, "-h").stdout
        for token in ("<bool>", "<str>", "<int", "<float", "<path>", "<list"):
            assert token not in out, (path, token)
    listing = ok("--help").stdout
    # a command's help ends where its sentence ends, not where its source line did
    assert re.search(r"models\s+List what --model takes: the named models .* and the supported model", listing, re.S)
    assert not re.search(r"and the\s*│?\n\s*│?\s+supported", listing)


def test_version_and_completion():
    from headatlas import __version__

    assert ok("--version").stdout.strip() == f"headatlas {__version__}"
    assert "--install-completion" in ok("--help").stdout
    # what bash asks of the script once its completion is installed (`--show-completion` prints that
    # script for the shell it detects among its parents: `sh` under make, which it does not support)
    asked = {"_HEADATLAS_COMPLETE": "complete_bash", "COMP_WORDS": "headatlas que", "COMP_CWORD": "1"}
    words = CliRunner().invoke(app, [], prog_name="headatlas", env=asked)
    assert words.exit_code == 0 and words.stdout.split() == ["query"], words.stdout + words.stderr
    asked.update(COMP_WORDS="headatlas query he", COMP_CWORD="2")
    words = CliRunner().invoke(app, [], prog_name="headatlas", env=asked)
    assert words.exit_code == 0 and words.stdout.split() == ["heads"], words.stdout + words.stderr


def test_hints_are_spelled_as_the_program_is_typed_here(tmp_path, monkeypatch):
    from headatlas.cli.messages import command_name, runnable

    script = tmp_path / ".venv" / "bin" / "headatlas"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "demo"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert command_name() == os.path.join(".venv", "bin", "headatlas")
    assert runnable("run `headatlas analyze CORPUS` first") == "run `.venv/bin/headatlas analyze CORPUS` first"
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin")  # activated: the plain name works
    assert command_name() == "headatlas"
    monkeypatch.setattr(sys, "argv", ["pytest"])  # not started as the console script
    assert command_name() == "headatlas"


def test_trend_sparkline_spans_the_values_own_range():
    """Two lifts far from 0, one falling a little and one rising: drawn from 0 both were two full
    bars; drawn over their own range one falls and the other rises."""
    from headatlas.cli.sparklines import SPARK, trend_line

    falling, rising = trend_line("lift", [1.035, 1.015]), trend_line("lift", [1.142, 1.194])
    assert falling == f"lift {SPARK[-1]}{SPARK[0]}  (1.015 … 1.035)"
    assert rising == f"lift {SPARK[0]}{SPARK[-1]}  (1.142 … 1.194)"
    assert trend_line("lift", [0.5, None, 0.75, 1.0]) == f"lift {SPARK[0]} {SPARK[4]}{SPARK[-1]}  (0.5 … 1)"
    assert trend_line("lift", [2.0, 2.0]) == f"lift {SPARK[3]}{SPARK[3]}  (2 … 2)"


def test_piped_prose_wraps_at_100_columns_and_notes_wrap_on_a_terminal(monkeypatch):
    """`metrics | head`: piped with no width given, a table whose column holds prose (the
    definitions) wraps it at 100 columns, every column kept; a note on stderr wraps at a
    terminal's width, and stays one line in a file or a pipe."""
    import io

    from rich.console import Console

    from headatlas.cli import messages

    piped = ok("metrics", columns=None).stdout
    assert _header(piped)[:3] == ["column", "spec", "definition"]
    assert all(len(line) <= 100 for line in piped.splitlines()), piped
    text = "a note long enough to need more than one line of a narrow terminal, " * 3
    for terminal, lines in ((True, 4), (False, 1)):
        sink = io.StringIO()
        monkeypatch.setattr(messages, "stderr", Console(file=sink, width=60, force_terminal=terminal, no_color=True))
        messages.note(text.strip())
        said = sink.getvalue().splitlines()
        assert len(said) >= lines if terminal else len(said) == 1, said
        assert all(len(line) <= 60 for line in said) or not terminal
        assert " ".join(" ".join(said).split()) == f"note: {' '.join(text.split())}"
