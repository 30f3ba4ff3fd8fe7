"""Roles on stored runs: stability on halves of the replicate groups (a run built by hand, group by
group, with known answers), the halves' metrics against the views, several random-weights
controls (``analyze --control N``) and ``query roles --stability`` through the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sqlalchemy import text

GROUPS = range(16)


def prev_sum(head: int, group: int) -> int:
    """Attention on the previous token summed over a group's 1000 rows: head 0 holds 0.9 in every
    group; head 1 holds 0.9 in the even groups and 0.19 (under the 0.2 threshold) in the odd ones."""
    base = 900 if head == 0 or group % 2 == 0 else 190
    return base + group % 3


def hand_run(path) -> int:
    """A finished run of 1 layer × 2 heads stored as 16 replicate groups (one batch each): every
    metric but attn_to_prev sits at its chance (lift 1, entropy under ln n̄ = ln 100 by 0.005)."""
    from headatlas.service.storage.db import transaction
    from headatlas.service.storage.store import Store

    Store(path).ensure_schema()
    with transaction(path) as conn:
        run = conn.execute(
            text(
                "INSERT INTO runs (run_key, name, corpus, corpus_fingerprint, model, model_name, n_layers, n_heads, "
                "d_head, params, seq_len, short_range, engine, device, status) VALUES ('hand-key', 'hand', 'hand', "
                "'fp', 'hand', 'hand', 1, 2, 8, '{\"seq_len\": 128, \"short_range\": 4}', 128, 4, 'embedded', 'cpu', "
                "'done') RETURNING run_id"
            )
        ).scalar()
        for g in GROUPS:
            ids = {"r": run, "g": g}
            conn.execute(
                text(
                    "INSERT INTO run_chance (run_id, batch_id, rep, windows, pairs, same_sentence_pairs, "
                    "same_token_pairs, attn_rows, same_word_pairs, punct_tokens) "
                    "VALUES (:r, :g, :g, 10, 100, 30, 2, 1000, 2, 50)"
                ),
                ids,
            )
            conn.execute(
                text(
                    "INSERT INTO pair_hist (run_id, batch_id, rep, distance, count, same_sentence, same_token, "
                    "same_word) VALUES (:r, :g, :g, 1, 50, 25, 1, 1), (:r, :g, :g, 10, 50, 5, 1, 1)"
                ),
                ids,
            )
            for h in (0, 1):
                conn.execute(
                    text(
                        "INSERT INTO head_stats (run_id, batch_id, rep, layer, head, high_pairs, sim_sum_all, "
                        "sim_sum_high, same_sentence_high, same_token_high, attended_high, attn_to_cls, attn_to_sep, "
                        "attn_to_punct, attn_to_self, attn_to_prev, attn_to_next, attn_entropy, same_word_high, "
                        "anchor_frequent, anchored_windows) VALUES (:r, :g, :g, 0, :h, 10, 0, 0, 5, 0, 10, 10, 10, "
                        "50, 100, :prev, 5, :ent, 0, 0, 10)"
                    ),
                    {**ids, "h": h, "prev": prev_sum(h, g), "ent": 4600.0 + g},
                )
                conn.execute(
                    text(
                        "INSERT INTO dist_hist (run_id, batch_id, rep, layer, head, distance, count, attended, "
                        "same_sentence) VALUES (:r, :g, :g, 0, :h, 1, 10, 10, 5)"
                    ),
                    {**ids, "h": h},
                )
    return run


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    path = tmp_path_factory.mktemp("stability") / "hand.duckdb"
    return path, hand_run(path)


def _by_role(columns, rows):
    return {(r[0], r[1], r[2]): dict(zip(columns, r)) for r in rows}


def test_stability_on_hand_made_groups(hand):
    """Both heads earn previous-token on the whole run; head 1 holds it on the even groups only,
    so it is unstable. By hand: head 1's value 0.545, its jackknife se 0.0917 (the groups
    alternate 0.9 / 0.19), t = 3.76 with 15 df; Holm multiplies its p by 17 (rank 2 of 18)."""
    from headatlas.service.reports import role_views, roles, significance
    from headatlas.service.storage.store import Store

    path, run = hand
    with Store(path).checked_read() as conn:
        columns, rows = roles.roles(conn, run, stability=True)
    got = _by_role(columns, rows)
    assert set(got) == {(0, 0, "previous-token"), (0, 1, "previous-token")}
    sums = np.array([prev_sum(1, g) for g in GROUPS], dtype=float)
    value = sums.sum() / 16000
    loo = (sums.sum() - sums) / 15000
    se = math.sqrt(15 / 16 * float(((loo - loo.mean()) ** 2).sum()))
    head1 = got[(0, 1, "previous-token")]
    assert head1["value"] == pytest.approx(value, rel=1e-12)
    assert head1["p"] == pytest.approx(significance.t_sf((value - 0.2) / se, 15), rel=1e-9)
    assert head1["family"] == 18 and head1["p_holm"] == pytest.approx(17 * head1["p"], rel=1e-9)
    assert (head1["half_a"], head1["half_b"], head1["stable"]) == (True, False, False)
    head0 = got[(0, 0, "previous-token")]
    assert (head0["half_a"], head0["half_b"], head0["stable"]) == (True, True, True)
    assert role_views.stable_counts(columns, rows)["previous-token"] == 1
    assert role_views.role_counts(columns, rows)["previous-token"] == 2


def test_a_half_has_its_own_metrics_and_jackknife(hand):
    from headatlas.service.reports import halves, role_rules
    from headatlas.service.reports.intervals import jackknife_halfwidth
    from headatlas.service.storage.store import Store

    path, run = hand
    with Store(path).checked_read() as conn:
        groups = halves.run_groups(conn, run)
        even, odd = halves.split(groups)
        columns, rows, context = halves.head_rows(conn, run, odd, role_rules.ROLE_METRICS)
    assert groups == list(GROUPS) and even == list(range(0, 16, 2)) and odd == list(range(1, 16, 2))
    head1 = dict(zip(columns, rows[1]))
    sums = np.array([prev_sum(1, g) for g in odd], dtype=float)
    assert head1["attn_to_prev"] == pytest.approx(sums.sum() / 8000, rel=1e-12)
    half = jackknife_halfwidth(list((sums.sum() - sums) / 7000))
    assert head1["attn_to_prev_hi"] - head1["attn_to_prev"] == pytest.approx(half, rel=1e-9)
    assert head1["attn_to_cls_lift"] == pytest.approx(1.0) and head1["within_sentence_lift_dm"] == pytest.approx(1.0)
    assert context["uniform_entropy"] == pytest.approx(math.log(100)) and context["short_range_chance"] == 0.5


# --- a small random:tiny run and two controls, through the command line --------------------------------
def _analysed(tmp_path_factory, demo_corpus, folder: str, documents: int, *args: str):
    """The excerpt's first ``documents`` documents analysed by the command line with ``args``:
    (database, the run ids it printed)."""
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    where = tmp_path_factory.mktemp(folder)
    corpus = where / "corpus.txt"
    text = "\n\n".join(demo_corpus.read_text(encoding="utf-8").split("\n\n")[:documents]) + "\n"
    corpus.write_text(text, encoding="utf-8")
    db = where / f"{folder}.duckdb"
    done = CliRunner().invoke(app, ["analyze", str(corpus), *args, "-q", "--db", str(db)])
    assert done.exit_code == 0, done.output
    return db, [int(x) for x in done.output.split()]


@pytest.fixture(scope="module")
def tiny_db(tmp_path_factory, demo_corpus):
    return _analysed(
        tmp_path_factory, demo_corpus, "controls", 2, "--model", "random:tiny", "--control", "2", "--name", "two"
    )


def test_control_2_stores_two_controls_with_different_weights(tiny_db, tiny_model):
    from headatlas.service.engine.model import control_model
    from headatlas.service.reports import compare, queries
    from headatlas.service.storage.store import Store, resolve_run

    db, ids = tiny_db
    assert len(ids) == 3
    with Store(db).checked_read() as conn:
        run = resolve_run(conn, ids[0])
        controls = compare.controls_of(conn, run)
        assert [c.run_id for c in controls] == ids[1:]
        assert [c.name for c in controls] == ["two-control", "two-control-1"]  # seed 0 keeps the name it had
        assert [compare.control_seed(c) for c in controls] == [0, 1]
        assert compare.control_of(conn, run).run_id == ids[1]
        assert "seed 0" in controls[0].model_name and "seed 1" in controls[1].model_name
        assert all(compare.same_windows(conn, run.run_id, c.run_id) for c in controls)
        values = [
            [r[2] for r in queries.heads(conn, c.run_id, sort=None)[1]]  # within_sentence per head
            for c in controls
        ]
        assert values[0] != values[1]
        assert compare.parameter_differences(controls[0], controls[1]) == []
    seed0, seed1 = (control_model(tiny_model, seed=s) for s in (0, 1))
    assert seed0.weights_key != seed1.weights_key
    w0, w1 = (dict(m.model.named_parameters())["encoder.layer.0.attention.self.query.weight"] for m in (seed0, seed1))
    assert not np.allclose(w0.detach().numpy(), w1.detach().numpy())


def test_halves_over_every_group_are_the_views(tiny_db):
    from headatlas.service.reports import halves, queries, role_rules, roles
    from headatlas.service.storage.store import Store

    db, ids = tiny_db
    with Store(db).checked_read() as conn:
        groups = halves.run_groups(conn, ids[0])
        columns, rows, context = halves.head_rows(conn, ids[0], groups, role_rules.ROLE_METRICS)
        # the intervals the role tests read, with their degrees of freedom (what a table shows is
        # clipped to each range)
        view_columns, view_rows = queries.heads(conn, ids[0], anchors=0, ci=True, clip=False, with_df=True)
        whole = roles.run_context(conn, ids[0])
    assert len(groups) >= 2
    for row, view in zip(rows, view_rows):
        mine, theirs = dict(zip(columns, row)), dict(zip(view_columns, view))
        for c in columns:
            assert mine[c] == pytest.approx(theirs[c], rel=1e-9, nan_ok=True), c
    assert context == pytest.approx(whole, rel=1e-12)


def _bits(value):
    """``value`` with every float as its bytes: equal only bit for bit (NaN equal to NaN)."""
    import struct

    if isinstance(value, float):
        return struct.pack("<d", value)
    if isinstance(value, (list, tuple)):
        return [_bits(v) for v in value]
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def window_db(tmp_path_factory, demo_corpus):
    """A tiny run whose replicate groups are windows: 16 groups, 8 a half."""
    args = ["--model", "random:tiny", "--seq-len", "32", "--sentences", "punct", "--replicates", "window"]
    return _analysed(tmp_path_factory, demo_corpus, "windows", 3, *args)


@pytest.mark.parametrize("which", ["window_db", "hand"])
def test_halves_in_one_statement_and_a_derivation_as_before(which, request, monkeypatch):
    """``subsets_head_rows`` (both halves from one plan of the view chain, each half a pseudo run)
    against ``head_rows`` one half at a time, and a finished run's whole derivation either way: a
    tiny run's, and the run by hand's (whose roles hold on one half or both); the old way also
    reads the heads and the layers with their own statements (``head_metrics``, ``layer_metrics``)
    rather than from the ``*_reps`` rows the derivation reads for their intervals, and the role
    tests' heads again.
    One DuckDB thread: with more, the views' sums of the ``*_dm`` chances (a join's rows summed in
    the order they arrive) differ in their last bits between two runs of the same statement.
    Bit for bit: every column of every half but those, whose order follows the run id's hash (the
    pseudo run's, not the run's): within 1e-12; and every kind of the derivation, flags included."""
    from headatlas.service.reports import halves, query_support, role_rules, stored
    from headatlas.service.storage.store import Store

    db, run = request.getfixturevalue(which)
    ids = run if isinstance(run, list) else [run]
    with Store(db).checked_read() as conn:
        conn.execute(text("SET threads = 1"))
        try:
            subsets = [h for h in halves.split(halves.run_groups(conn, ids[0])) if len(h) >= 2]
            assert len(subsets) == 2
            together = halves.subsets_head_rows(conn, ids[0], subsets, role_rules.ROLE_METRICS)
            alone = [halves.head_rows(conn, ids[0], h, role_rules.ROLE_METRICS) for h in subsets]
            new = stored.derive(conn, ids[0])
            with monkeypatch.context() as m:
                m.setattr(
                    halves,
                    "subsets_head_rows",
                    lambda conn, run, subsets, metrics: [halves.head_rows(conn, run, h, metrics) for h in subsets],
                )
                m.setattr(query_support, "shared_cache", lambda: None)  # heads and layers by their own statements
                old = stored.derive(conn, ids[0])
        finally:
            conn.execute(text("RESET threads"))
    assert _bits(new) == _bits(old)
    if which == "hand":  # roles earned, and tested on each half
        assert {r[-3:] for r in new["roles"][1]} >= {(True, True, True), (True, False, False)}
    for (columns, rows, context), (want_columns, want_rows, want_context) in zip(together, alone, strict=True):
        assert columns == want_columns and len(rows) == len(want_rows) > 0
        assert _bits(context) == _bits(want_context)
        for row, want in zip(rows, want_rows):
            for c, got, expected in zip(columns, row, want):
                if "_dm" in c and isinstance(got, float) and isinstance(expected, float):
                    assert got == pytest.approx(expected, rel=1e-12, nan_ok=True), c
                else:
                    assert _bits(got) == _bits(expected), c


def test_query_roles_stability_from_the_command_line(tiny_db):
    from typer.testing import CliRunner

    from headatlas.cli.main import app
    from headatlas.service.reports import role_rules

    db, ids = tiny_db
    runner = CliRunner()
    done = runner.invoke(app, ["query", "roles", "--run", "two", "--stability", "--format", "json", "--db", str(db)])
    assert done.exit_code == 0, done.output
    data = json.loads(done.output)
    assert {(d["layer"], d["head"]) for d in data} == {(l, h) for l in range(2) for h in range(4)}
    assert all({"half_a", "half_b", "stable", "p_holm", "family"} <= set(d) for d in data)
    for d in data:  # stable: held on both halves; no role, or halves too few to test: nothing to hold
        halves = [d["half_a"], d["half_b"]]
        assert d["stable"] == (None if None in halves else all(halves)), d
        if d["role"] == role_rules.NONE:
            assert halves == [None, None], d
    table = runner.invoke(app, ["query", "roles", "--run", "two", "--stability", "--db", str(db)])
    assert table.exit_code == 0, table.output
    out = " ".join(table.output.split())
    assert "(head, role) tests" in out or "values tested" in out
    assert "control seed 0 (run" in out and "control seed 1 (run" in out and "heads per role:" in out
    plain = runner.invoke(app, ["query", "roles", "--run", "two", "--format", "json", "--db", str(db)])
    assert "stable" not in json.loads(plain.output)[0]


def test_compare_finds_every_control(tiny_db):
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    db, ids = tiny_db
    runner = CliRunner()
    done = runner.invoke(app, ["compare", "two", "--format", "json", "--db", str(db)])
    assert done.exit_code == 0, done.output
    data = json.loads(done.stdout)  # warnings go to stderr
    assert sorted({d["run_b"] for d in data}) == ids[1:]
    assert len(data) == 2 * sum(1 for d in data if d["run_b"] == ids[1])
    table = runner.invoke(app, ["compare", "two", "--db", str(db)])
    out = " ".join(table.output.split())
    assert "control, seed 0" in out and "control, seed 1" in out


@pytest.mark.parametrize(
    ("args", "seen"),
    [
        (["--control"], 1),  # followed by the corpus: one control (as the flag always meant)
        (["--control", "--quiet"], 1),  # followed by an option
        (["--control", "3"], 3),
        (["--control=2"], 2),
        ([], 0),
    ],
)
def test_control_takes_an_optional_count(args, seen, tmp_path, monkeypatch):
    """The count parsed, without analysing anything: the analysis is replaced by a recorder."""
    from typer.testing import CliRunner

    from headatlas.cli import analysis_commands, main

    got = {}
    monkeypatch.setattr(analysis_commands, "_analyze", lambda request, **k: got.update(control=request.control))
    done = CliRunner().invoke(main.app, ["analyze", *args, "corpus.txt", "--db", str(tmp_path / "x.duckdb")])
    assert done.exit_code == 0, done.output
    assert got == {"control": seen}
    bad = CliRunner().invoke(main.app, ["analyze", "corpus.txt", "--control", "-1"])
    assert bad.exit_code == 2
