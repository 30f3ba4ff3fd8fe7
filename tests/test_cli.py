"""End to end through the installed console script, on the real default model and real text."""

from __future__ import annotations

import hashlib
import json

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def analysed(tmp_path_factory, demo_corpus):
    """One real run: the first two documents of the shipped excerpt, default model."""
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("e2e")
    corpus = root / "two.txt"
    corpus.write_text("\n\n".join(demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]), encoding="utf-8")
    db = root / "e2e.duckdb"
    done = run_cli("analyze", str(corpus), "--db", str(db), "--name", "two-docs", "--batch-size", "8")
    assert done.returncode == 0, done.stderr
    return corpus, db, done


def test_analyze_prints_what_the_heads_do(analysed):
    _, _, done = analysed
    assert "Layer progression" in done.stdout
    assert "Word-repetition heads" in done.stdout
    # every printed lift says what it is measured against
    assert "*_lift_dm: chance matched to the head's own distances" in done.stdout
    assert "windows/s" in done.stderr


def test_the_next_commands_work_as_printed(analysed, cli, tmp_path, monkeypatch):
    """The commands `analyze` suggests read the database it wrote: --db is in them where the user
    gave one (typed elsewhere, without it they would open another database)."""
    import shlex

    _, db, done = analysed
    lines = done.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("next: "))
    commands = [shlex.split(line.removeprefix("next: ").strip()) for line in lines[start : start + 2]]
    monkeypatch.chdir(tmp_path)  # no headatlas.duckdb here
    for command in commands:
        assert command[0].endswith("headatlas") and "--db" in command, command
        assert command[command.index("--db") + 1] == str(db)
        out = cli(*command[1:])
        assert out.returncode == 0, out.stderr


NEW_COLUMNS = (
    "within_sentence_chance_dm",
    "within_sentence_lift_dm",
    "repetition_chance_dm",
    "repetition_lift_dm",
    "repetition_words",
    "repetition_words_chance",
    "repetition_words_lift",
    "repetition_words_chance_dm",
    "repetition_words_lift_dm",
    "attn_to_cls_lift",
    "attn_to_sep_lift",
    "attn_to_punct_lift",
    "anchor_frequency_share",
)


def test_query_heads_json_ci_has_every_baseline_and_interval(analysed, cli):
    _, db, _ = analysed
    out = cli("query", "heads", "--db", str(db), "--format", "json", "--ci")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 6 * 12
    checked = 0
    for row in rows:
        for name in NEW_COLUMNS:
            assert name in row, name
            assert row[name] is not None, (name, row["layer"], row["head"])
        for name, value in row.items():
            if name.endswith(("_lo", "_hi")) or f"{name}_lo" not in row or value is None:
                continue
            lo, hi = row[f"{name}_lo"], row[f"{name}_hi"]
            assert lo is not None and hi is not None, name
            assert lo <= value <= hi, (name, lo, value, hi)
            checked += 1
        # punctuation repeats are excluded from word repetition, never added
        assert row["repetition_words"] <= row["repetition"] + 1e-12
    assert checked > 72 * 20
    # counts carry no interval
    assert "high_pairs_lo" not in rows[0] and "windows_lo" not in rows[0]


def test_query_heads_json_uses_spec_names(analysed, cli):
    _, db, _ = analysed
    out = cli("query", "heads", "--db", str(db), "--format", "json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 6 * 12
    for name in (
        "layer",
        "head",
        "within_sentence",
        "within_sentence_chance",
        "within_sentence_lift",
        "repetition",
        "repetition_chance",
        "mean_distance",
        "mean_distance_chance",
        "short_range_share",
        "noise_share",
        "attn_to_cls",
        "attn_to_sep",
        "attn_to_punct",
        "attn_to_self",
        "attn_to_prev",
        "attn_to_next",
        "attn_entropy",
        "top_anchors",
    ):
        assert name in rows[0], name
    for row in rows:
        assert 0.0 <= row["within_sentence"] <= 1.0
        assert 0.0 <= row["noise_share"] <= 1.0
        assert 1.0 <= row["mean_distance"] <= 127.0
        total = row["attn_to_cls"] + row["attn_to_sep"] + row["attn_to_punct"]
        assert total <= 1.0 + 1e-6


def test_query_heads_sort_top_layer(analysed, cli):
    _, db, _ = analysed
    out = cli(
        "query",
        "heads",
        "--db",
        str(db),
        "--layer",
        "5",
        "--sort",
        "within_sentence_lift",
        "--top",
        "3",
        "--format",
        "json",
    )
    rows = json.loads(out.stdout)
    assert [r["layer"] for r in rows] == [5, 5, 5]
    lifts = [r["within_sentence_lift"] for r in rows]
    assert lifts == sorted(lifts, reverse=True)


def test_query_heads_refuses_a_mistyped_or_empty_sort_in_one_line(analysed, cli):
    _, db, _ = analysed
    typo = cli("query", "heads", "--db", str(db), "--sort", "within_sentance_lift_dm")
    assert typo.returncode == 2
    assert typo.stderr.strip().splitlines() == [
        "error: --sort 'within_sentance_lift_dm': not a metric of the heads; did you mean within_sentence_lift_dm, "
        "within_sentence_lift or within_sentence_chance_dm? `headatlas metrics` lists every metric"
    ]
    # the run has no probe: its scores are NULL for every head, a sort by them orders nothing
    unprobed = cli("query", "heads", "--db", str(db), "--sort", "induction_score")
    assert unprobed.returncode == 2
    lines = unprobed.stderr.strip().splitlines()
    assert len(lines) == 1 and "run 1 has no probe" in lines[0] and "--probe" in lines[0], unprobed.stderr


def test_query_distances_has_chance_and_sparkline(analysed, cli):
    _, db, _ = analysed
    out = cli("query", "distances", "--db", str(db), "--layer", "2", "--head", "3")
    assert out.returncode == 0, out.stderr
    assert "high   " in out.stdout and "chance " in out.stdout
    rows = json.loads(cli("query", "distances", "--db", str(db), "--layer", "2", "--format", "json").stdout)
    assert sum(r["chance_share"] for r in rows) == pytest.approx(1.0)
    assert sum(r["share"] for r in rows) == pytest.approx(1.0)
    bad = cli("query", "distances", "--db", str(db), "--layer", "6")
    assert bad.returncode != 0 and "layers 0..5" in bad.stderr


def test_query_boundaries_and_layers_csv(analysed, cli):
    _, db, _ = analysed
    out = cli("query", "boundaries", "--db", str(db), "--format", "csv")
    assert out.stdout.splitlines()[0].startswith("layer,within_sentence,within_sentence_chance")
    assert len(out.stdout.splitlines()) == 7
    out = cli("query", "layers", "--db", str(db), "--run", "two-docs", "--format", "csv")
    assert len(out.stdout.splitlines()) == 7


def test_sql_reads_and_refuses_writes(analysed, cli):
    _, db, _ = analysed
    out = cli("sql", "SELECT count(*) AS n FROM head_metrics", "--db", str(db), "--format", "json")
    assert json.loads(out.stdout) == [{"n": 72}]
    out = cli("sql", "-", "--db", str(db), "--format", "csv", input="SELECT layer FROM layer_metrics ORDER BY layer")
    assert out.stdout.split() == ["layer", "0", "1", "2", "3", "4", "5"]
    out = cli("sql", "SELECT * FROM anchors", "--db", str(db), "--max-rows", "5", "--format", "csv")
    assert len(out.stdout.splitlines()) == 6 and "truncated" in out.stderr
    refused = cli("sql", "DROP TABLE runs", "--db", str(db))
    assert refused.returncode != 0 and "refused" in refused.stderr and "Traceback" not in refused.stderr
    leak = cli("sql", "SELECT * FROM read_csv('/etc/passwd')", "--db", str(db))
    assert leak.returncode != 0


def test_rerun_is_idempotent(analysed, cli):
    corpus, db, _ = analysed
    again = cli("analyze", str(corpus), "--db", str(db), "--quiet")
    assert again.returncode == 0, again.stderr
    runs = json.loads(cli("runs", "--db", str(db), "--format", "json").stdout)
    assert len(runs) == 1 and runs[0]["status"] == "done"
    windows = runs[0]["windows"]
    assert (
        windows
        == json.loads(cli("sql", "SELECT count(*) AS n FROM run_windows", "--db", str(db), "--format", "json").stdout)[
            0
        ]["n"]
    )


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


BAD_INPUTS = {
    "empty": ("empty.txt", b"", "empty"),
    "binary": ("blob.txt", b"abc\x00\x01\x02" * 100, "binary"),
    "utf8": ("latin.txt", "caf\u00e9 au lait.\n".encode("latin-1"), "UTF-8"),
    "json-field": ("docs.jsonl", b'{"body": "Some text."}\n', "--text-field"),
    "no-text": ("blank.jsonl", b'{"text": ""}\n{"text": "   "}\n', "no document"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_corpus_gives_one_line_error_and_changes_nothing(case, analysed, cli, tmp_path):
    _, db, _ = analysed
    name, content, hint = BAD_INPUTS[case]
    bad = tmp_path / name
    bad.write_bytes(content)
    before = _digest(db)
    out = cli("analyze", str(bad), "--db", str(db), "--model", "random:tiny")
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and hint in lines[0] and name in lines[0]
    assert _digest(db) == before


@pytest.mark.parametrize(
    "args,hint",
    [
        (["--model", "./no-such-model"], "no such folder"),
        (["--select", "top:7"], "--select"),
        (["--device", "cuda:9"], "--device"),
    ],
)
def test_bad_options_give_one_line_error(args, hint, analysed, cli):
    corpus, db, _ = analysed
    before = _digest(db)
    out = cli("analyze", str(corpus), "--db", str(db), *args)
    assert out.returncode != 0
    assert hint in out.stderr and "Traceback" not in out.stderr
    assert _digest(db) == before


def test_analyze_reads_stdin(cli, tmp_path):
    db = tmp_path / "stdin.duckdb"
    text = "The cat sat on the mat. It was warm.\n\nA second document follows here, short and plain."
    out = cli("analyze", "-", "--db", str(db), "--model", "random:tiny", "--quiet", input=text)
    assert out.returncode == 0, out.stderr
    runs = json.loads(cli("runs", "--db", str(db), "--format", "json").stdout)
    assert runs[0]["windows"] == 2 and runs[0]["name"].startswith("stdin")


def test_queries_on_missing_database_name_the_fix(cli, tmp_path):
    out = cli("query", "heads", "--db", str(tmp_path / "none.duckdb"))
    assert out.returncode != 0 and "headatlas analyze" in out.stderr
