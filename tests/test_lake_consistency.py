"""A lake's ledger and files under writers that interleave, in-process: a reservation committed
after another writer stored the batch leaves one ledger row; `db copy` folds the rows a lake
holds twice; a run deleted while a writer stores it leaves no rows; `db compact` refuses a second
compaction in one line and keeps the files an open transaction reads."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from test_lake import _cli, _one_batch, _run

pytestmark = pytest.mark.integration


def _ledger(store, run_id: int) -> list[tuple]:
    with store.read() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                text("SELECT batch_id, status FROM batches WHERE run_id = :r ORDER BY ALL"), {"r": run_id}
            )
        ]


def test_a_reservation_committed_after_another_writer_stored_the_batch_leaves_one_ledger_row(
    lake, tiny_model, small_corpus
):
    from headatlas.service.storage.store import Store, reserve_batches, store_batches

    store = Store(lake.url, data_path=lake.data_path)
    run, _ = _run(store, "stale", tiny_model)
    result = _one_batch(tiny_model, small_corpus)
    # writer A reads the ledger to reserve batch 0 (no row) and is stopped before its commit …
    held = store.write()
    a = held.__enter__()
    assert reserve_batches(a, run.run_id, [0]) == 1
    # … writer B, given A's messages meanwhile, reserves and stores the batch …
    assert store_batches(store, run.run_id, [(0, result)]) == 1
    held.__exit__(None, None, None)  # … A resumes: its reservation commits (it only appended a row)
    assert store_batches(store, run.run_id, [(0, result)]) == 0  # A's group: found stored
    assert _ledger(store, run.run_id) == [(0, "done")]


def test_db_copy_of_a_lake_holding_a_batch_twice_copies_it_once(lake, tiny_model, small_corpus, tmp_path):
    import json

    from headatlas.service.storage.store import Store, store_batches

    store = Store(lake.url, data_path=lake.data_path)
    run, _ = _run(store, "twice", tiny_model)
    assert store_batches(store, run.run_id, [(0, _one_batch(tiny_model, small_corpus))]) == 1
    # what an earlier version left: a reservation beside the stored batch
    with store.write() as conn:
        conn.execute(
            text(
                "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts) VALUES (:r, 0, 0, 'reserved', 0)"
            ),
            {"r": run.run_id},
        )
    copied = _cli("db", "copy", lake.url, str(tmp_path / "copy.duckdb"), "-f", "json")
    assert copied.exit_code == 0, copied.stderr
    counts = {r["table"]: (r["source_rows"], r["target_rows"]) for r in json.loads(copied.stdout)}
    assert counts["batches"] == (1, 1) and counts["run_windows"][0] == counts["run_windows"][1] > 0
    assert _ledger(Store(tmp_path / "copy.duckdb"), run.run_id) == [(0, "done")]


def test_db_compact_keeps_the_files_an_open_transaction_reads(lake, tiny_model, small_corpus):
    from headatlas.service.storage.store import Store, store_batches

    store = Store(lake.url, data_path=lake.data_path)
    result = _one_batch(tiny_model, small_corpus)
    for key in ("c1", "c2", "c3"):  # a commit, and files, per run: small files to merge
        run, _ = _run(store, key, tiny_model)
        store_batches(store, run.run_id, [(0, result)])
    backend = lake.backend()
    on_disk = lambda: len(list(lake.data_path.rglob("*.parquet")))  # noqa: E731
    reader = backend.connect(read_only=True)  # a writer's or reader's transaction, begun before the compaction
    try:
        sql = "SELECT count(*), sum(high_pairs), (SELECT count(*) FROM run_windows) FROM head_stats"
        fresh = backend.connect(read_only=True)
        want = fresh.execute(sql).fetchall()
        fresh.close()
        reader.execute("BEGIN")
        reader.execute("SELECT count(*) FROM runs").fetchall()  # its snapshot, none of the data read yet
        before = on_disk()
        facts = backend.maintain(older_than_days=0)  # every old snapshot expires
        assert facts["files_after"] < facts["files_before"] and facts["snapshots_after"] == 1
        assert reader.execute(sql).fetchall() == want  # its files are still there
        reader.execute("COMMIT")
    finally:
        reader.close()
    assert on_disk() > before  # merged files added, none deleted yet
    backend.maintain(older_than_days=0, files_grace_s=0)  # past the grace: deleted
    assert on_disk() < before


def test_a_second_db_compact_while_one_runs_is_refused_in_one_line(lake):
    from headatlas.service.storage.backends import lake_compaction

    backend = lake.backend()
    token = lake_compaction.claim(backend)  # a compaction in progress
    try:
        second = _cli("db", "compact", "--db", lake.url)
        assert second.exit_code == 2, second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and "another `db compact`" in second.stderr
    finally:
        lake_compaction.release_claim(backend, token)
    again = _cli("db", "compact", "--db", lake.url)
    assert again.exit_code == 0, again.stderr


def test_a_run_deleted_while_a_writer_stores_it_leaves_no_rows_on_a_lake(lake, tiny_model, small_corpus):
    from headatlas.service.errors import StoreConflict
    from headatlas.service.storage import run_labels
    from headatlas.service.storage.store import Store, ingest_batches, reserve_batches, run_is_there

    store = Store(lake.url, data_path=lake.data_path)
    run, _ = _run(store, "deleted", tiny_model)
    result = _one_batch(tiny_model, small_corpus)
    # `runs delete` has deleted the run's rows, not committed yet …
    deleting = store.write()
    d = deleting.__enter__()
    run_labels.delete(d, run.run_id)
    # … a writer reserves a batch of the run (holding its row) and stores it …
    store.atomically(
        lambda c: run_is_there(c, run.run_id, run.run_key, hold=True) and reserve_batches(c, run.run_id, [0])
    )
    storing = store.write()
    s = storing.__enter__()
    assert run_is_there(s, run.run_id, run.run_key)  # the delete is not committed
    assert ingest_batches(s, run.run_id, [(0, result)]) == 1
    with pytest.raises(StoreConflict):  # the reservation rewrote the run's row: the delete is refused …
        deleting.__exit__(None, None, None)
    storing.__exit__(None, None, None)
    store.delete_run(run.run_id)  # … and tried again, it deletes what the writer stored
    with store.write() as conn:  # the writer's next group finds the run gone
        assert not run_is_there(conn, run.run_id, run.run_key)
    with store.read() as conn:
        for table in ("batches", "run_windows", "head_stats", "run_chance"):
            left = conn.execute(text(f"SELECT count(*) FROM {table} WHERE run_id = :r"), {"r": run.run_id}).scalar()
            assert left == 0, f"{left} {table} rows of the deleted run"
