"""The lake backend (DuckLake: catalogue in this machine's PostgreSQL, Parquet data in a folder),
in-process: the schema a file gets, an embedded run stored as on a file and read back by every
query, the read-only sandbox, and exactly once without keys (two transactions storing one batch,
two opening one run, two claiming one fire: the second commit is refused and, tried again, finds
the first's work)."""

from __future__ import annotations

import pytest
from queue_support import assert_same_statistics, stored
from sqlalchemy import text

from headatlas.service.errors import StoreConflict, StoreError
from headatlas.service.params import AnalysisParams

PARAMS = AnalysisParams(seq_len=32)


# random:tiny spends most of a run's CPU per batch, not per window (the shipped excerpt's first two
# documents, 74 windows: 8.6 s of CPU in batches of 2, 5.2 s in batches of 8, 2.4 s in batches of 32,
# on a loaded machine): a test that needs several batches or commits takes batches of 8, one that
# needs a stored run and nothing of its batches takes batches of 32.
def _analyze(store, corpus, model, batch_size: int = 8, flush_s: float = 10.0):
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus

    return analyze_corpus(
        str(corpus),
        store=store,
        model=model,
        params=PARAMS,
        corpus=survey_corpus(str(corpus)),
        batch_size=batch_size,
        flush_s=flush_s,
    )


def assert_same_rows(got: tuple[list, list], want: tuple[list, list]) -> None:
    """The same columns and rows; floats to 1e-9 relative (the engines sum in other orders)."""
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for row_a, row_b in zip(got[1], want[1], strict=True):
        for column, x, y in zip(got[0], row_a, row_b, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                assert x == pytest.approx(y, rel=1e-9, abs=1e-12), (column, row_a, row_b)
            else:
                assert x == y, (column, row_a, row_b)


def _shape(target) -> list[tuple]:
    from headatlas.service.storage import db

    with db.transaction(target, read_only=True) as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text(
                    "SELECT table_name, column_name, data_type FROM information_schema.columns "
                    "WHERE table_catalog = current_database() ORDER BY ALL"
                )
            )
        ]


def test_a_lake_gets_the_schema_a_file_gets(lake, tmp_path):
    from headatlas.service.storage import db

    path = tmp_path / "f.duckdb"
    db.upgrade(path)
    backend = lake.backend()
    assert _shape(backend) == _shape(path)  # every table and view, column by column
    with db.checked_read(backend) as conn:
        assert db.current_revision(conn) == db.head_revision()
        assert not db.has_keys(conn)
    with db.transaction(path, read_only=True) as conn:  # the file keeps its keys
        assert db.has_keys(conn)
        assert conn.execute(
            text(
                "SELECT count(*) FROM duckdb_constraints() WHERE table_name = 'runs' AND constraint_type = 'PRIMARY KEY'"
            )
        ).scalar()
    assert db.upgrade(backend) == (db.head_revision(), db.head_revision())  # an upgrade of a current lake


def test_a_lake_made_by_an_older_headatlas_is_upgraded_to_the_head(lake_template, tmp_path, monkeypatch):
    import lake_support
    from alembic import command

    from headatlas.service.storage import db

    older = lake_support.new_lake(tmp_path)  # an empty catalogue
    monkeypatch.setenv("HEADATLAS_DATA_PATH", str(older.data_path))
    try:
        backend = older.backend()
        with backend.session() as conn:  # the schema as 0008 left it, views of 0006 included
            config = db._alembic_config()
            config.attributes["connection"] = conn
            command.upgrade(config, "0008_replicates")
            conn.commit()
        with pytest.raises(StoreError, match="db upgrade"):
            with db.checked_read(backend):
                pass
        assert db.upgrade(backend) == ("0008_replicates", db.head_revision())
        assert _shape(backend) == _shape(lake_template.backend())
    finally:
        lake_support.remove_lake(older)


def test_an_embedded_run_on_a_lake_stores_and_reads_what_a_file_does(lake, tiny_model, small_corpus, tmp_path):
    import headatlas
    from headatlas.service.reports import layer_queries, queries
    from headatlas.service.reports.export import export_run
    from headatlas.service.storage.readonly import run_readonly_sql
    from headatlas.service.storage.store import Store

    path = tmp_path / "f.duckdb"
    on_file = _analyze(Store(path), small_corpus, tiny_model)
    store = Store(lake.url, data_path=lake.data_path)
    on_lake = _analyze(store, small_corpus, tiny_model)
    assert on_lake.status == on_file.status == "done" and on_lake.run_key == on_file.run_key
    windows = stored(str(path), on_file.run_id)
    assert len(windows["run_windows"]) > 4 * 8  # several batches
    assert_same_statistics(stored(store.backend, on_lake.run_id), windows)
    for query in (queries.heads, layer_queries.layers, layer_queries.boundaries):
        with Store(path).checked_read() as a, store.checked_read() as b:
            assert_same_rows(query(b, on_lake.run_id), query(a, on_file.run_id))
    # a resumed run finds everything stored: nothing analysed twice
    assert _analyze(store, small_corpus, tiny_model).run_id == on_lake.run_id
    assert_same_statistics(stored(store.backend, on_lake.run_id), windows)
    listed = store.list_runs()[0]
    assert listed["windows"] == len(windows["run_windows"]) and listed["compute_s"] > 0

    # export: the same rows per table
    _run, from_file = export_run(path, on_file.run_id, "parquet", tmp_path / "ef")
    _run, from_lake = export_run(lake.url, on_lake.run_id, "parquet", tmp_path / "el")
    counts = {t.table: t.rows for t in from_file}
    assert {t.table: t.rows for t in from_lake} == counts and counts["head_stats"] > 0

    # the Python API and the sandbox of `headatlas sql`
    atlas = headatlas.connect(lake.url, data_path=lake.data_path)
    assert atlas.run(on_lake.name).heads().num_rows == tiny_model.n_layers * tiny_model.n_heads
    result = run_readonly_sql(store.backend, "SELECT sum(windows) FROM chance_totals")
    assert result.rows == [(len(windows["run_windows"]),)]
    for refused in (
        "DELETE FROM runs",
        "SELECT * FROM postgres_query('__ducklake_metadata_lake', 'SELECT pg_read_file(''/etc/hostname'')')",
        "SELECT * FROM __ducklake_metadata_lake.ducklake_snapshot",
        "SELECT * FROM ducklake_expire_snapshots('lake', older_than => now())",
        "SELECT * FROM read_csv('/etc/hostname')",
        "ATTACH ':memory:' AS other",
    ):
        with pytest.raises(StoreError):
            run_readonly_sql(store.backend, refused)
    assert store.get_run(on_lake.run_id).status == "done"


def test_a_run_ending_on_a_lake_stores_its_results_as_on_a_file(lake, small_corpus, tmp_path, cli):
    """`analyze` on a lake stores the run's results when it ends, as on a file: the same numbers (to
    the last bits of the engines' sums), the roles view in the lake's sandbox equal to `query
    roles`, and a change to the run makes them stale there too."""
    import json

    from headatlas.service.storage import run_results
    from headatlas.service.storage.readonly import run_readonly_sql
    from headatlas.service.storage.store import Store
    from tests.test_stored_results import computed, every_result, same_results

    path = tmp_path / "f.duckdb"
    for target in (str(path), lake.url):
        done = cli("analyze", str(small_corpus), "--model", "random:tiny", "--seq-len", "32", "--db", target, "--quiet")
        assert done.returncode == 0, done.stderr
    store, on_file = Store(lake.url, data_path=lake.data_path), Store(path)
    run = store.list_runs()[0]["run_id"]
    with store.checked_read() as b, on_file.checked_read() as a:
        for kind in run_results.KINDS:
            assert run_results.load(b, run, kind) is not None, kind
            same_results(run_results.load(b, run, kind), run_results.load(a, run, kind), kind)
        same_results(every_result(b, run), computed(b, run))
    shown = cli("query", "roles", "--stability", "-f", "json", "--db", lake.url)
    assert shown.returncode == 0, shown.stderr
    result = run_readonly_sql(store.backend, "SELECT * EXCLUDE (run_id) FROM roles")
    got = [dict(zip(result.columns, r)) for r in result.rows]
    assert got == [{c: d[c] for c in result.columns} for d in json.loads(shown.stdout)]
    store.set_status(run, "running")  # its content changed: stale
    with store.checked_read() as b:
        assert run_results.load(b, run, "roles") is None
    assert run_readonly_sql(store.backend, "SELECT count(*) FROM roles").rows == [(0,)]


def _one_batch(model, corpus):
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.windows import TokenClasses, Window, collate
    from headatlas.workers.submit import batch_payloads

    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    _batch_id, _n, payload = next(
        iter(
            batch_payloads(
                str(corpus), model, PARAMS, model="random:tiny", dtype="float32", batch_size=3, database_id=""
            )
        )
    )
    windows = [Window.from_message(row) for row in payload["windows"]]
    return analyze_batch(model, collate(windows, tokens.pad_id), PARAMS, tokens, documents=payload["documents"])


def _run(store, key: str, model):
    return store.find_or_create_run(
        run_key=key,
        name=f"run-{key}",
        corpus="hand",
        corpus_fingerprint=key,
        model=model.describe(),
        params=PARAMS.to_dict(),
        engine="embedded",
        device="cpu",
    )


def test_two_transactions_storing_one_batch_count_it_once(lake, tiny_model, small_corpus):
    from headatlas.service.storage.store import Store, ingest_batches, reserve_batches

    store = Store(lake.url, data_path=lake.data_path)
    run, _ = _run(store, "once", tiny_model)
    result = _one_batch(tiny_model, small_corpus)
    store.atomically(lambda conn: reserve_batches(conn, run.run_id, [0]))
    # two writers store batch 0 at the same moment: both transactions open, both stored it
    first, second = store.write(), store.write()
    a, b = first.__enter__(), second.__enter__()
    assert ingest_batches(a, run.run_id, [(0, result)]) == 1
    assert ingest_batches(b, run.run_id, [(0, result)]) == 1
    first.__exit__(None, None, None)  # commits
    with pytest.raises(StoreConflict):
        second.__exit__(None, None, None)  # refused: it deleted the reservation the first deleted
    assert store.ingest(run.run_id, [(0, result)]) == 0  # tried again: found stored, skipped
    with store.read() as conn:
        q = lambda sql: conn.execute(text(sql), {"r": run.run_id}).scalar()  # noqa: E731
        assert q("SELECT count(*) FROM run_windows WHERE run_id = :r") == len(result.window_ids)
        assert q("SELECT count(*) FROM batches WHERE run_id = :r") == 1
        assert q("SELECT sum(windows) FROM run_chance WHERE run_id = :r") == len(result.window_ids)
    # another batch id with the same windows: reserved by the store itself, then refused whole
    with pytest.raises(StoreError, match="already counted"):
        store.ingest(run.run_id, [(1, result)])
    with store.read() as conn:
        assert conn.execute(
            text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run.run_id}
        ).scalar() == len(result.window_ids)


def test_two_transactions_opening_one_run_make_one_run(lake, tiny_model):
    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store

    store = Store(lake.url, data_path=lake.data_path)
    opened = []
    first, second = store.write(), store.write()
    a, b = first.__enter__(), second.__enter__()
    for conn in (a, b):  # what find_or_create_run does, interleaved
        db.serialize(conn)
        opened.append(db.next_id(conn, "runs", "run_id"))
    assert opened == [1, 1]  # both saw no run
    first.__exit__(None, None, None)
    with pytest.raises(StoreConflict):
        second.__exit__(None, None, None)
    # through the store: ids one apart, one run per key
    run_a, created_a = _run(store, "k-a", tiny_model)
    run_b, created_b = _run(store, "k-b", tiny_model)
    again, created = _run(store, "k-a", tiny_model)
    assert (created_a, created_b, created) == (True, True, False)
    assert (run_a.run_id, run_b.run_id, again.run_id) == (1, 2, 1)


def test_a_run_whose_plan_and_last_batch_commit_at_once_ends(lake, tiny_model, small_corpus, monkeypatch):
    """Two writers of a lake: one records the run's complete plan (the submitter's last OpenRun)
    while the other stores the run's last batch. Each asks whether the run is complete inside its
    own transaction and sees the other's work missing; the batch's writer asks again after its
    commit, but the plan is not committed yet. The plan's writer must ask after its commit too,
    or the run stays running with every batch stored (and `submit --wait` waits for ever)."""
    from headatlas.service.statuses import RunStatus
    from headatlas.service.storage import queue_store
    from headatlas.service.storage.store import Store, ingest_batches, reserve_batches

    store = Store(lake.url, data_path=lake.data_path)
    result = _one_batch(tiny_model, small_corpus)
    meta = {
        "run_key": "plan-and-batch",
        "name": "plan-and-batch",
        "corpus": "hand",
        "corpus_fingerprint": "plan-and-batch",
        "model": tiny_model.describe(),
        "params": PARAMS.to_dict(),
        "device": None,
        "batch_size": 3,
        "batches": None,  # the submitter is still cutting the corpus
        "windows": None,
    }
    run, plan = queue_store.open_run(store, meta)
    assert plan.batches is None
    store.atomically(lambda conn: reserve_batches(conn, run.run_id, [0]))

    asked_inside = queue_store.finish_if_complete
    other_writer_done: list[bool] = []

    def other_writer_stores_the_last_batch(conn, run_id):
        if not other_writer_done:  # the plan's transaction is open and has not committed
            other_writer_done.append(True)
            with store.write() as other:
                assert ingest_batches(other, run_id, [(0, result)]) == 1
                asked_inside(other, run_id)
            store.atomically(lambda c: asked_inside(c, run_id))  # after its commit: no plan yet
            with store.read() as other:
                assert queue_store.plan_of(other, run_id).batches is None
        asked_inside(conn, run_id)

    monkeypatch.setattr(queue_store, "finish_if_complete", other_writer_stores_the_last_batch)
    queue_store.open_run(store, {**meta, "batches": 1, "windows": len(result.window_ids)})
    assert other_writer_done
    assert store.get_run(run.run_id).status == RunStatus.DONE


def test_two_claims_of_one_fire_on_a_lake_make_one(lake):
    from datetime import timedelta

    from headatlas.service.schedules import Cadence
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.store import now

    sched = schedule_store.add(
        lake.url,
        name="nightly",
        corpus="c.txt",
        model="random:tiny",
        dtype="float32",
        batch_size=4,
        params=PARAMS.to_dict(),
        cadence=Cadence(None, 60, "UTC", now()),
        only_new=True,
    )
    fire = sched.next_fire + timedelta(seconds=0)
    a, b = {"holder": "beat-a", "lease_s": 60}, {"holder": "beat-b", "lease_s": 60}
    assert schedule_store.claim(lake.url, sched.schedule_id, fire, kind="manual", doc_ids=["d1"], at=fire, **a)
    assert not schedule_store.claim(lake.url, sched.schedule_id, fire, kind="manual", at=fire, **b)
    # beat-a died: beat-b takes its fire over once the lease has run out, with its documents
    later = fire + timedelta(seconds=61)
    taken = schedule_store.claim(lake.url, sched.schedule_id, later, kind="manual", doc_ids=["d2"], at=later, **b)
    assert taken is not None and (taken.fire_time, taken.doc_ids, taken.resumed) == (fire, ["d1"], True)
    schedule_store.finish_fire(lake.url, sched.schedule_id, fire, status="submitted", run_key="k", documents=1)
    with schedule_store.read(lake.url) as conn:
        assert schedule_store.seen_documents(conn, sched.schedule_id) == {"d1"}
        assert schedule_store.in_hand(conn, sched.schedule_id) is None
    with pytest.raises(Exception, match="exists"):
        schedule_store.add(
            lake.url,
            name="nightly",
            corpus="c.txt",
            model="random:tiny",
            dtype="float32",
            batch_size=4,
            params=PARAMS.to_dict(),
            cadence=Cadence(None, 60, "UTC", now()),
            only_new=False,
        )


def _cli(*args: str, env: dict | None = None):
    from typer.testing import CliRunner

    from headatlas.cli.main import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250", "NO_COLOR": "1", **(env or {})})


def test_at_a_snapshot_reads_the_state_then_and_compaction_keeps_the_numbers(lake, tiny_model, small_corpus, tmp_path):
    import json

    import headatlas
    from headatlas.service.storage.store import Store

    store = Store(lake.url)
    run = _analyze(store, small_corpus, tiny_model, flush_s=0.0)  # a commit (a snapshot) per batch
    listed = json.loads(_cli("runs", "--db", lake.url, "-f", "json").stdout)
    done_at = listed[0]["snapshot"]
    with store.read() as conn:  # the snapshot that stored the run's first batch
        first = conn.execute(text("SELECT min(snapshot_id) FROM batches WHERE status = 'done'")).scalar()
    assert first < done_at
    heads_now = _cli("query", "heads", "--db", lake.url, "-f", "json").stdout
    # later commits: a second run, and the run's rows compacted into other files
    other = tmp_path / "other.txt"
    other.write_text("Another text. It has two sentences.\n", encoding="utf-8")
    _analyze(store, other, tiny_model)
    merged = _cli("db", "compact", "--db", lake.url, "--keep-days", "7", "-f", "json")
    assert merged.exit_code == 0, merged.stderr
    facts = json.loads(merged.stdout)[0]  # each table's small files merged, every snapshot kept
    assert facts["files_after"] < facts["files_before"] and facts["snapshots_after"] >= facts["snapshots_before"]
    # as of the run's end: the same numbers, one run; as of its first batch: that batch's windows only
    assert same_numbers(
        _cli("query", "heads", "--run", str(run.run_id), "--db", lake.url, "--at", str(done_at), "-f", "json").stdout,
        heads_now,
    )
    assert json.loads(
        _cli("sql", "SELECT count(*) AS n FROM runs", "--db", lake.url, "--at", str(done_at), "-f", "json").stdout
    ) == [{"n": 1}]
    assert len(json.loads(_cli("runs", "--db", lake.url, "-f", "json").stdout)) == 2
    compared = _cli("compare", "1", "2", "--db", lake.url, "-f", "json")
    assert compared.exit_code == 0 and json.loads(compared.stdout), compared.stderr
    with Store(lake.url, at=first).checked_read() as conn:
        early = conn.execute(text("SELECT windows FROM chance_totals WHERE run_id = :r"), {"r": run.run_id}).scalar()
    with store.checked_read() as conn:
        total = conn.execute(text("SELECT windows FROM chance_totals WHERE run_id = :r"), {"r": run.run_id}).scalar()
    assert 0 < early < total
    assert headatlas.connect(lake.url, at=done_at).runs().num_rows == 1
    report = _cli("report", "--db", lake.url, "--at", str(done_at), "--out", str(tmp_path / "r.html"))
    assert report.exit_code == 0 and f"snapshot {done_at}" in report.stdout
    assert f"report --at {done_at}" in (tmp_path / "r.html").read_text(encoding="utf-8")
    # a file keeps no snapshots: --at says so in one line
    bad = _cli("query", "heads", "--db", str(tmp_path / "x.duckdb"), "--at", "3")
    assert bad.exit_code == 2 and "keeps no snapshots" in bad.stderr

    # compaction keeping no old snapshot: the same numbers; the old snapshots are gone
    compacted = _cli("db", "compact", "--db", lake.url, "--keep-days", "0", "-f", "json")
    assert compacted.exit_code == 0, compacted.stderr
    facts = json.loads(compacted.stdout)[0]
    assert facts["snapshots_after"] == 1 < facts["snapshots_before"]
    assert same_numbers(
        _cli("query", "heads", "--run", str(run.run_id), "--db", lake.url, "-f", "json").stdout, heads_now
    )
    gone = _cli("query", "heads", "--db", lake.url, "--at", str(first))
    assert gone.exit_code == 2 and f"--at {first}" in gone.stderr


def test_db_copy_moves_every_run_and_schedule_file_to_lake_and_back(lake, tiny_model, small_corpus, tmp_path):
    from headatlas.service.schedules import Cadence
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.store import Store, now

    path, back = tmp_path / "f.duckdb", tmp_path / "back.duckdb"
    run = _analyze(Store(path), small_corpus, tiny_model, batch_size=32)
    schedule_store.add(
        path,
        name="hourly",
        corpus=str(small_corpus),
        model="random:tiny",
        dtype="float32",
        batch_size=2,
        params=PARAMS.to_dict(),
        cadence=Cadence(None, 3600, "UTC", now()),
        only_new=False,
    )
    heads = _cli("query", "heads", "--db", str(path), "-f", "json").stdout
    for src, dst in ((str(path), lake.url), (lake.url, str(back))):
        copied = _cli("db", "copy", src, dst, "-f", "json")
        assert copied.exit_code == 0, copied.stderr
        import json

        counts = {r["table"]: (r["source_rows"], r["target_rows"]) for r in json.loads(copied.stdout)}
        assert counts["runs"] == (1, 1) and counts["schedules"] == (1, 1) and counts["head_stats"][0] > 0
        assert all(a == b for a, b in counts.values())
        assert same_numbers(_cli("query", "heads", "--db", dst, "-f", "json").stdout, heads)
    # the copy hands out new ids after the copied ones, and refuses a target that holds runs
    copied_run = _analyze(Store(back), small_corpus, tiny_model, batch_size=32)
    assert copied_run.run_id == run.run_id  # the copied run, found by key
    again = _cli("db", "copy", str(path), lake.url)
    assert again.exit_code == 2 and "already holds runs" in again.stderr


def test_a_catalogue_password_is_never_printed(lake, tiny_model, small_corpus, tmp_path, caplog):
    from dataclasses import replace

    from headatlas.service.storage.store import Store

    secret = "s3cr3t-Pa55"
    with_password = replace(lake, password=secret)  # trust authentication here: taken and ignored
    _analyze(Store(with_password.url), small_corpus, tiny_model, batch_size=32)  # a run to read
    outputs = [
        _cli("runs", "--db", with_password.url, "--data-path", str(lake.data_path)),  # a global option, here too
        _cli("db", "current", "--db", with_password.url),
        _cli("db", "upgrade", "--db", with_password.url),
        _cli("query", "heads", "--db", with_password.url),
        _cli("runs", "--db", with_password.url.replace(lake.name, "ha_test_no_such_db")),  # fails to connect
        _cli("query", "heads", "--db", with_password.url, "--at", "999999"),
        _cli("config", env={"HEADATLAS_DB": with_password.url}),
    ]
    assert outputs[0].exit_code == 0 and "password=***" in outputs[1].stdout
    assert outputs[4].exit_code == 2 and "ha_test_no_such_db" in outputs[4].stderr
    for result in outputs:
        assert secret not in result.stdout + result.stderr
    assert secret not in caplog.text
    assert secret not in str(Store(with_password.url).backend) and secret not in repr(Store(with_password.url).backend)


def same_numbers(a: str, b: str) -> bool:
    """Two JSON outputs hold the same values, floats to 1e-12 relative: DuckDB sums a column's
    values in an order of its own (merged files, parallel scans), so the last bit may differ."""
    import json
    import math

    def same(x, y) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15) or (math.isnan(x) and math.isnan(y))
        if isinstance(x, dict) and isinstance(y, dict):
            return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, list) and isinstance(y, list):
            return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
        return x == y

    return same(json.loads(a), json.loads(b))


def test_analyze_on_a_lake_says_its_compute_time_and_an_old_snapshot_is_read_at_a_later_one(lake, small_corpus):
    """The run's summary on a lake sums its batches' compute seconds (the run's row is not
    updated per batch there); a snapshot older than the schema is not upgraded: the advice is a
    later snapshot, not `db upgrade`."""
    import re

    from headatlas.service.storage.db import head_revision

    out = _cli("analyze", str(small_corpus), "--db", lake.url, "--model", "random:tiny", "--seq-len", "32")
    assert out.exit_code == 0, out.output
    seconds = re.search(r"([0-9.]+) s compute", out.stdout)
    assert seconds is not None and float(seconds.group(1)) > 0, out.stdout
    old = _cli("query", "heads", "--db", lake.url, "--at", "1")
    assert old.exit_code != 0
    message = " ".join(old.stderr.split())
    assert "predates schema" in message and head_revision() in message and "later --at" in message, message
    assert "db upgrade" not in message, message
