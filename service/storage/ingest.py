"""Storing batch results: idempotent ingest in the caller's transaction, a lake's reservations,
and what a run has stored already (for resuming it); ``store.store_batches`` runs them in
transactions of their own.

Bulk rows go in through Arrow tables (batch_rows.py, mixing_rows.py) registered on the raw
DuckDB connection and ``INSERT … SELECT`` inside the batch's transaction (about 100× faster than
executemany); the batches stored in one transaction are summed per replicate group and key
first (batch_rows.py), the ledger and ``run_windows`` keeping one row per batch and per window. A batch already in the ledger (``batches``) is skipped: a redelivered batch is
harmless.
"""

from __future__ import annotations

import pyarrow as pa
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.engine.results import BatchResult
from headatlas.service.errors import StoreError
from headatlas.service.statuses import BatchStatus, sql
from headatlas.service.storage import db
from headatlas.service.storage.batch_rows import batch_tables
from headatlas.service.storage.effect_rows import insert_run_effects
from headatlas.service.storage.example_rows import example_tables
from headatlas.service.storage.mixing_rows import MIXING_TABLES, mixing_tables

Unreserved = db.Unreserved
DONE = sql(BatchStatus.DONE)
NOT_TRIED = "fsst"  # the compression DuckDB does not try on a file's storing transactions


def ingest_batches(conn: Connection, run_id: int, items: list[tuple[int, BatchResult]]) -> int:
    """Store batch results inside the caller's transaction; a batch already stored is skipped.
    On a lake each batch must hold a ledger row from an earlier transaction (``reserve_batches``;
    else ``Unreserved``): its rows are deleted here, which is what makes a concurrent store of
    the same batch conflict. Returns the number of batches newly stored."""
    return len(ingest_batch_ids(conn, run_id, items))


def ingest_batch_ids(conn: Connection, run_id: int, items: list[tuple[int, BatchResult]]) -> list[int]:
    """``ingest_batches``, returning the ids of the batches newly stored. A batch id given twice
    is stored once (its first result)."""
    first: dict[int, BatchResult] = {}
    for batch_id, res in items:
        first.setdefault(batch_id, res)
    items = list(first.items())
    keys = db.has_keys(conn)
    ledger = conn.execute(
        text(
            "SELECT batch_id, status FROM batches WHERE run_id = :r AND batch_id IN "
            "(SELECT unnest(CAST(:ids AS INTEGER[])))"
        ),
        {"r": run_id, "ids": [b for b, _ in items]},
    ).all()
    done = {b for b, status in ledger if status == BatchStatus.DONE}
    fresh = [(b, res) for b, res in items if b not in done]
    fresh_ids = [b for b, _ in fresh]
    if not keys:
        held = sorted({b for b, status in ledger if status != BatchStatus.DONE})
        unreserved = [b for b in fresh_ids if b not in held]
        if unreserved:
            raise Unreserved(unreserved)
        # every row but a done one goes: the reservations of the batches stored now, and those of
        # batches already stored, which a writer committed after reading the ledger before another
        # writer stored them (a writer stopped inside its reservation): one row per batch, always
        if held:
            conn.execute(
                text(
                    f"DELETE FROM batches WHERE run_id = :r AND status <> {DONE} AND batch_id IN "
                    "(SELECT unnest(CAST(:ids AS INTEGER[])))"
                ),
                {"r": run_id, "ids": held},
            )
    if not fresh:
        return []
    raw = db.driver_connection(conn)
    if keys:
        # a file: its write connection ends with this transaction, so the setting ends with it.
        # Storing a group on one thread takes a third less CPU per window than on DuckDB's pool
        # (waking its threads for each of a dozen inserts, and for the checkpoint on closing,
        # costs more than they save), docs/benchmarks.md "Storing"
        raw.execute("SET threads = 1")
        # DuckDB tries FSST on every string segment it writes; the anchors' 600,000 strings a
        # transaction (window ids and tokens, each repeated per head) always end up in a
        # dictionary, and trying FSST on them cost 6-9 % of storing's CPU. The price: window ids
        # (distinct hex) stored plain, a MiniLM file 3 % larger (docs/benchmarks.md "Storing")
        raw.execute(f"SET disabled_compression_methods = '{NOT_TRIED}'")
    tables = batch_tables(run_id, fresh)
    tables.update(mixing_tables(run_id, fresh))
    tables.update(example_tables(run_id, fresh))  # the heads' top examples (migration 0021)
    # a stream of record batches (csm_bins) is inserted one batch per statement (insert_stream)
    streams = {name: tables.pop(name) for name in list(tables) if isinstance(tables[name], pa.RecordBatchReader)}
    try:
        for name, table in tables.items():
            raw.register(f"_in_{name}", table)
        # a window counted by another batch of this run would be counted twice: refuse
        # fetch every row: DuckDB refuses other work while a result is unfinished
        clash = conn.execute(
            text("SELECT count(*) FROM run_windows w JOIN _in_run_windows i USING (run_id, window_id)")
        ).all()[0][0]
        if clash:
            raise StoreError(f"run {run_id}: {clash} window(s) of this batch were already counted by another batch")
        if keys:
            conn.exec_driver_sql(
                "INSERT INTO documents SELECT DISTINCT ON (doc_id) * FROM _in_documents ON CONFLICT DO NOTHING"
            )
            conn.exec_driver_sql(
                "INSERT INTO windows SELECT DISTINCT ON (window_id) * FROM _in_windows ON CONFLICT DO NOTHING"
            )
        else:  # content-addressed rows: the ones not stored yet
            conn.exec_driver_sql(
                "INSERT INTO documents SELECT DISTINCT ON (doc_id) * FROM _in_documents i "
                "WHERE NOT EXISTS (SELECT 1 FROM documents d WHERE d.doc_id = i.doc_id)"
            )
            conn.exec_driver_sql(
                "INSERT INTO windows SELECT DISTINCT ON (window_id) * FROM _in_windows i "
                "WHERE NOT EXISTS (SELECT 1 FROM windows w WHERE w.window_id = i.window_id)"
            )
        for name in (
            "run_windows",
            "head_stats",
            "named_head_sums",
            "run_chance",
            "dist_hist",
            "pair_hist",
            "anchors",
            "anchor_tokens",
            "anchor_layers",
            "csm_bins",
            "head_examples",
            "example_windows",
        ):
            if name in tables:
                conn.exec_driver_sql(f"INSERT INTO {name} BY NAME SELECT * FROM _in_{name}")
            elif name in streams:
                insert_stream(conn, name, streams[name])
        for name in MIXING_TABLES:
            if name in tables:
                conn.exec_driver_sql(f"INSERT INTO {name} BY NAME SELECT * FROM _in_{name}")
        # what the batches' causal effects are measured against (SPEC §9)
        insert_run_effects(conn, run_id, [res.effects for _, res in fresh])
        if keys:
            conn.exec_driver_sql(
                "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts, compute_s, ingested_at) "
                f"SELECT run_id, batch_id, n_windows, {DONE}, 1, compute_s, now() FROM _in_batches "
                f"ON CONFLICT (run_id, batch_id) DO UPDATE SET status = {DONE}, compute_s = excluded.compute_s, "
                "ingested_at = excluded.ingested_at, error = NULL"
            )
            conn.execute(
                text("UPDATE runs SET compute_s = compute_s + :s WHERE run_id = :r"),
                {"s": float(sum(res.compute_s for _, res in fresh)), "r": run_id},
            )
        else:  # the batches' rows deleted above; compute_s is summed from here when read
            conn.exec_driver_sql(
                "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts, compute_s, ingested_at) "
                f"SELECT run_id, batch_id, n_windows, {DONE}, 1, compute_s, now() FROM _in_batches"
            )
    finally:
        for name in tables:
            raw.unregister(f"_in_{name}")
    return fresh_ids


def insert_stream(conn: Connection, table: str, stream: pa.RecordBatchReader) -> int:
    """Insert ``stream``'s record batches into ``table``, one ``INSERT`` a batch, in the caller's
    transaction; returns the rows inserted. One statement reading the whole stream kept every
    record batch it had read alive until it ended: the 43 million ``csm_bins`` cells of a
    4,096-token window (about 3 GB of Arrow columns) were all held at once, and under a 6 GiB
    address-space cap the insert failed (docs/benchmarks.md, "Long windows"). A batch at a time,
    what DuckDB holds is the table's own blocks, which its memory limit bounds."""
    raw = db.driver_connection(conn)
    name = f"_in_{table}"
    rows = 0
    for batch in stream:
        raw.register(name, batch)
        try:
            conn.exec_driver_sql(f"INSERT INTO {table} BY NAME SELECT * FROM {name}")
        finally:
            raw.unregister(name)
        rows += batch.num_rows
    return rows


def reserve_batches(conn: Connection, run_id: int, batch_ids: list[int]) -> int:
    """On a lake, in a transaction committed before the batches are stored: a ``reserved``
    ledger row for each batch that has no row yet. Storing a batch deletes the rows it finds, so
    two transactions storing the same batch both delete one row and DuckLake refuses the second
    commit (docs/architecture.md, "Exactly once on a lake"). Returns the rows added."""
    have = {
        r[0]
        for r in conn.execute(
            text(
                "SELECT DISTINCT batch_id FROM batches WHERE run_id = :r AND batch_id IN "
                "(SELECT unnest(CAST(:ids AS INTEGER[])))"
            ),
            {"r": run_id, "ids": list(batch_ids)},
        )
    }
    missing = sorted(set(batch_ids) - have)
    if missing:
        raw = db.driver_connection(conn)
        raw.register("_in_reserved", pa.table({"batch_id": pa.array(missing, type=pa.int32())}))
        try:
            conn.execute(
                text(
                    "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts) "
                    f"SELECT :r, batch_id, 0, {sql(BatchStatus.RESERVED)}, 0 FROM _in_reserved"
                ),
                {"r": run_id},
            )
        finally:
            raw.unregister("_in_reserved")
    return len(missing)


def done_window_ids(conn: Connection, run_id: int) -> set[str]:
    """The windows the run has counted."""
    rows = conn.execute(text("SELECT window_id FROM run_windows WHERE run_id = :r"), {"r": run_id})
    return {r[0] for r in rows}


def next_batch_id(conn: Connection, run_id: int) -> int:
    """One past the run's largest batch id in the ledger (0 for a run with none)."""
    return int(
        conn.execute(
            text("SELECT coalesce(max(batch_id), -1) + 1 FROM batches WHERE run_id = :r"), {"r": run_id}
        ).scalar_one()
    )


def mixing_windows(conn: Connection, run_id: int) -> int:
    """Windows of this run that already carry mixing measures (for the --attribution-windows cap)."""
    return int(
        conn.execute(
            text(
                "SELECT coalesce(sum(windows), 0) FROM mixing_stats "
                "WHERE run_id = :r AND method = 'attention' AND layer = 0 AND head = -1"
            ),
            {"r": run_id},
        ).scalar_one()
    )
