"""A finished run's stored results (service/storage/run_results.py, service/reports/stored.py):
equal to what the readers compute, used only while current (the run's content and the deriving
code), never once stale, and seen by SQL through the ``roles`` view, in the sandbox too.

The run is built by hand (tests/test_role_stability.py: 16 replicate groups, known roles), so no
model runs here; the real MiniLM run is checked in tests/test_compare.py, an old database's
upgrade in tests/test_baselines.py and a lake in tests/test_lake.py."""

from __future__ import annotations

import json
import math

import pytest
from sqlalchemy import text

from tests.test_role_stability import hand_run

HEAD_OPTIONS = (
    {"ci": True},
    {},
    {"ci": True, "sort": "attn_to_prev"},
    {"sort": "attn_entropy", "ascending": True},
    {"ci": True, "layer": 0, "top": 1, "sort": "within_sentence_lift_dm"},
    {"anchors": 10},
    {"anchors": 0, "ci": True},
    {"ci": True, "clip": False},
)


@pytest.fixture()
def hand(tmp_path):
    from headatlas.service.reports import stored
    from headatlas.service.storage.store import Store

    path = tmp_path / "hand.duckdb"
    run = hand_run(path)
    assert stored.refresh(Store(path), run)
    return path, run


def _read(path):
    from headatlas.service.storage.store import Store

    return Store(path).checked_read()


# what a staleness test reads: whether a run's results are current is decided for the run, not for
# a reader's options (every option is compared while current, above and below)
STALE_HEAD_OPTIONS = ({"ci": True}, {"ci": True, "clip": False})


def every_result(conn, run: int, head_options=HEAD_OPTIONS) -> dict:
    """What each reader returns for the run, over the options the CLI and the web app pass."""
    from headatlas.service.reports import distance_queries, layer_queries, queries, roles

    out = {("heads", json.dumps(o, sort_keys=True)): queries.heads(conn, run, **o) for o in head_options}
    out["layers"] = layer_queries.layers(conn, run, ci=True)
    out["layers without intervals"] = layer_queries.layers(conn, run)  # the stored ones, intervals left out
    out["roles"] = roles.roles(conn, run)
    out["roles --stability"] = roles.roles(conn, run, stability=True)
    listed = {} if {} in head_options else head_options[0]
    heads = [(r[0], r[1]) for r in out[("heads", json.dumps(listed, sort_keys=True))][1]]
    for layer, head in dict.fromkeys([heads[0], heads[len(heads) // 2], heads[-1]]):  # a head's page
        out[("distances", layer, head)] = distance_queries.distances(conn, run, layer=layer, head=head, ci=True)
    return out


def same_results(got, want, where: str = "") -> None:
    """The same structure, columns, rows, ints, text, flags and None; floats to 1e-9 relative: DuckDB
    sums a view's values in an order of its own on a run of many rows (parallel aggregation), so the
    last bits of one result computed twice may differ already."""
    if isinstance(want, float) and isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15), (where, got, want)
    elif isinstance(want, (dict, list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), (where, got, want)
        if isinstance(want, dict):
            assert list(got) == list(want), where
            for key in want:
                same_results(got[key], want[key], f"{where}/{key}")
        else:
            for k, (a, b) in enumerate(zip(got, want)):
                same_results(a, b, f"{where}[{k}]")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def computed(conn, run: int, head_options=HEAD_OPTIONS) -> dict:
    from headatlas.service.reports import stored

    with stored.computed():
        return every_result(conn, run, head_options)


def test_stored_results_equal_the_computed_ones_number_for_number(hand):
    from headatlas.service.storage import run_results

    path, run = hand
    with _read(path) as conn:
        for kind in run_results.KINDS:
            assert run_results.load(conn, run, kind) is not None, kind  # read from the store
        assert every_result(conn, run) == computed(conn, run)  # ints, floats, None, text: all equal
        role_rows = conn.execute(text("SELECT * FROM roles WHERE run_id = :r"), {"r": run}).all()
        columns, rows = computed(conn, run)["roles --stability"]
    assert [tuple(r[1:]) for r in role_rows] == rows
    assert [n for n, _ in run_results.ROLE_COLUMNS] == columns


def _tamper(path, run: int) -> None:
    """Every stored number of the run made wrong (its key left as it is)."""
    from headatlas.service.storage.db import transaction

    with transaction(path) as conn:
        for kind, _columns, rows in conn.execute(
            text("SELECT kind, columns, rows FROM run_results WHERE run_id = :r"), {"r": run}
        ).all():
            wrong = [[-1.0 if isinstance(v, float) else v for v in r] for r in json.loads(rows)]
            conn.execute(
                text("UPDATE run_results SET rows = :rows WHERE run_id = :r AND kind = :k"),
                {"rows": json.dumps(wrong), "r": run, "k": kind},
            )
        conn.execute(text("UPDATE role_results SET value = -1 WHERE run_id = :r"), {"r": run})


def test_the_readers_use_the_stored_rows_while_current(hand):
    """Tampered stored rows under a current key are what the readers return: they read the store
    (the staleness tests below therefore show that a stale key sends them back to computing)."""
    path, run = hand
    _tamper(path, run)
    with _read(path) as conn:
        got, want = every_result(conn, run), computed(conn, run)
        assert got[("heads", json.dumps({"ci": True}))] != want[("heads", json.dumps({"ci": True}))]
        assert got["roles"] != want["roles"]
        assert got["layers without intervals"] != want["layers without intervals"]
        assert (
            got[("heads", json.dumps({"ci": True, "clip": False}))]
            == want[("heads", json.dumps({"ci": True, "clip": False}))]
        )
        assert {r[0] for r in conn.execute(text("SELECT value FROM roles WHERE run_id = :r"), {"r": run})} == {-1.0}


def _add_rows(path, run: int) -> None:
    """Another replicate group's sums added to the finished run (as a resumed or extended run)."""
    from headatlas.service.storage.db import transaction

    with transaction(path) as conn:
        conn.execute(
            text(
                "INSERT INTO head_stats (run_id, batch_id, rep, layer, head, high_pairs, sim_sum_all, sim_sum_high, "
                "same_sentence_high, same_token_high, attended_high, attn_to_cls, attn_to_sep, attn_to_punct, "
                "attn_to_self, attn_to_prev, attn_to_next, attn_entropy, same_word_high, anchor_frequent, "
                "anchored_windows) VALUES (:r, 99, 3, 0, 1, 10, 0, 0, 5, 0, 10, 10, 10, 50, 100, 950, 5, 4601, 0, 0, 10)"
            ),
            {"r": run},
        )


@pytest.mark.parametrize(
    "change",
    [
        "rows added",
        "a ledger row rewritten in place",
        "its fingerprint changed",
        "another derivation",
    ],
)
def test_stale_results_are_never_read(hand, change, monkeypatch):
    from headatlas.service.reports import stored
    from headatlas.service.storage import run_results
    from headatlas.service.storage.db import transaction
    from headatlas.service.storage.store import Store

    path, run = hand
    _tamper(path, run)  # were they read, every number would be wrong
    if change == "rows added":
        _add_rows(path, run)
    elif change == "a ledger row rewritten in place":
        with transaction(path) as conn:
            conn.execute(text("UPDATE run_chance SET punct_tokens = 51 WHERE run_id = :r AND rep = 0"), {"r": run})
    elif change == "its fingerprint changed":
        with transaction(path) as conn:
            conn.execute(text("UPDATE run_results SET fingerprint = 'another' WHERE run_id = :r"), {"r": run})
    else:
        monkeypatch.setattr(run_results, "derivation", lambda: "another version")
    with _read(path) as conn:
        for kind in run_results.KINDS:
            assert run_results.load(conn, run, kind) is None, kind
        assert every_result(conn, run, STALE_HEAD_OPTIONS) == computed(conn, run, STALE_HEAD_OPTIONS)
        if change != "another derivation":  # the view holds the derivation it was built with
            assert conn.execute(text("SELECT count(*) FROM roles WHERE run_id = :r"), {"r": run}).scalar() == 0
    if change == "another derivation":
        return  # the tampered rows are this code's again once it is back
    # stored again, the run's present rows: current again, and equal to what is computed
    assert stored.refresh(Store(path), run)
    with _read(path) as conn:
        assert run_results.load(conn, run, "roles") is not None
        assert every_result(conn, run, STALE_HEAD_OPTIONS) == computed(conn, run, STALE_HEAD_OPTIONS)
        assert conn.execute(text("SELECT count(*) FROM roles WHERE run_id = :r"), {"r": run}).scalar() > 0


def test_a_rename_or_a_tag_leaves_them_current_and_a_refresh_of_current_results_stores_nothing(hand):
    from headatlas.service.reports import stored
    from headatlas.service.storage import run_results
    from headatlas.service.storage.store import Store

    path, run = hand
    store = Store(path)
    store.rename_run(run, "renamed")
    store.tag_run(run, ["kept"], [])
    with _read(path) as conn:
        assert run_results.is_fresh(conn, run)
    assert stored.refresh(store, run) is False


def test_an_unfinished_run_stores_none_and_deleting_a_run_deletes_them(hand):
    from headatlas.service.reports import stored
    from headatlas.service.storage.store import Store

    path, run = hand
    store = Store(path)
    store.set_status(run, "running")
    with _read(path) as conn:
        assert conn.execute(text("SELECT count(*) FROM roles")).scalar() == 0  # its content changed (status)
    assert stored.refresh(store, run) is False
    store.set_status(run, "done")
    assert stored.refresh(store, run) is False  # the same content as when stored: current again
    store.delete_run(run)
    with _read(path) as conn:
        assert conn.execute(text("SELECT count(*) FROM run_results")).scalar() == 0
        assert conn.execute(text("SELECT count(*) FROM role_results")).scalar() == 0


def test_sql_sees_the_roles_view_in_its_sandbox(hand, cli):
    path, run = hand
    done = cli(
        "sql", "SELECT layer, head, role, stable FROM roles ORDER BY layer, head", "--db", str(path), "-f", "json"
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [(r["head"], r["role"], r["stable"]) for r in rows] == [
        (0, "previous-token", True),
        (1, "previous-token", False),
    ]
    scoped = cli("sql", "SELECT count(*) AS n FROM roles", "--db", str(path), "--run", str(run), "-f", "json")
    assert scoped.returncode == 0, scoped.stderr
    assert json.loads(scoped.stdout) == [{"n": 2}]


def test_db_upgrade_stores_the_results_of_finished_runs(tmp_path, cli):
    from headatlas.service.storage import run_results
    from headatlas.service.storage.db import transaction

    path = tmp_path / "hand.duckdb"
    run = hand_run(path)  # stored by hand: no results yet
    with _read(path) as conn:
        assert run_results.load(conn, run, "heads") is None
    done = cli("db", "upgrade", "--db", str(path))
    assert done.returncode == 0, done.stderr
    assert f"results stored for finished run(s) {run}" in done.stdout
    with _read(path) as conn:
        assert all(run_results.load(conn, run, k) is not None for k in run_results.KINDS)
        assert every_result(conn, run) == computed(conn, run)
    again = cli("db", "upgrade", "--db", str(path))
    assert again.returncode == 0 and "results stored" not in again.stdout  # current: nothing to do
    with transaction(path) as conn:
        assert conn.execute(text("SELECT count(*) FROM roles")).scalar() == 2


def test_no_view_reads_the_tables_the_fingerprint_leaves_out(tmp_path):
    """The results' fingerprint leaves out per-window tables no result reads (``NOT_READ``): no view
    of a new database may read them (the roles view, which computes the fingerprint, aside)."""
    import re

    import duckdb

    from headatlas.service.storage import run_results
    from headatlas.service.storage.db import upgrade

    path = tmp_path / "new.duckdb"
    upgrade(path)
    with duckdb.connect(str(path), read_only=True) as conn:
        views = conn.execute("SELECT view_name, sql FROM duckdb_views() WHERE NOT internal").fetchall()
    assert {"roles", "head_metrics"} <= {name for name, _ in views}
    for name, sql in views:
        if name in run_results.VIEWS:
            continue
        for table in run_results.NOT_READ:
            assert not re.search(rf"\b{table}\b", sql), (name, table)
