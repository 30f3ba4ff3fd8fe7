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


def _analyze(store, corpus, model, batch_size: int = 2):
    from headatlas.service.engine.runner import analyze_corpus, survey_corpus

    return analyze_corpus(
        str(corpus), store=store, model=model, params=PARAMS, corpus=survey_corpus(str(corpus)), batch_size=batch_size
    )


def assert_same_rows(got: tuple[list, list], want: tuple[list, list]) -> None:
    """The same columns and rows; floats to 1e-9 relative (the engines sum in other orders)."""
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1])
    for row_a, row_b in zip(got[1], want[1], strict=True):
        for x, y in zip(row_a, row_b, strict=True):
            if isinstance(x, float) and isinstance(y, float):
                assert x == pytest.approx(y, rel=1e-9, abs=1e-12), (row_a, row_b)
            else:
                assert x == y, (row_a, row_b)


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


def test_an_embedded_run_on_a_lake_stores_and_reads_what_a_file_does(lake, tiny_model, small_corpus, tmp_path):
    import headatlas
    from headatlas.service.reports import queries
    from headatlas.service.reports.export import export_run
    from headatlas.service.storage.readonly import run_readonly_sql
    from headatlas.service.storage.store import Store

    path = tmp_path / "f.duckdb"
    on_file = _analyze(Store(path), small_corpus, tiny_model)
    store = Store(lake.url, data_path=lake.data_path)
    on_lake = _analyze(store, small_corpus, tiny_model)
    assert on_lake.status == on_file.status == "done" and on_lake.run_key == on_file.run_key
    windows = stored(str(path), on_file.run_id)
    assert len(windows["run_windows"]) > 4  # several batches
    assert_same_statistics(stored(store.backend, on_lake.run_id), windows)
    for query in (queries.heads, queries.layers, queries.boundaries):
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
        only_new=False,
    )
    fire = sched.next_fire + timedelta(seconds=0)
    assert schedule_store.claim(lake.url, sched.schedule_id, fire, kind="manual")
    assert not schedule_store.claim(lake.url, sched.schedule_id, fire, kind="manual")
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
