"""The results store: runs, idempotent batch ingest, reads. The only module that writes.

Bulk rows go in through Arrow tables registered on the raw DuckDB connection and
``INSERT … SELECT`` inside the batch's transaction (about 100× faster than executemany).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.engine.results import CSM_KINDS, PAIR_HISTS, BatchResult
from headatlas.service.errors import RunNotFound, StoreError
from headatlas.service.metrics import CHANCE_SUMS, HEAD_SUMS  # every declared sum, the effects' included
from headatlas.service.storage import db, run_labels
from headatlas.service.storage.arrow_rows import TableRows
from headatlas.service.storage.backends import Backend, open_backend
from headatlas.service.storage.effect_rows import insert_run_effects
from headatlas.service.storage.mixing_rows import MIXING_TABLES, mixing_tables

RUN_COLUMNS = (
    "run_id, run_key, name, corpus, corpus_fingerprint, model, model_name, n_layers, n_heads, d_head, "
    "params, seq_len, short_range, engine, device, status, created_at, started_at, finished_at, "
    "compute_s, wall_s, error"
)


# DuckLake's virtual column snapshot_id: the snapshot that wrote the row
LAST_SNAPSHOT = (
    "greatest(r.snapshot_id, (SELECT max(b.snapshot_id) FROM batches b WHERE b.run_id = r.run_id), "
    "(SELECT max(p.snapshot_id) FROM probe_scores p WHERE p.run_id = r.run_id))"
)


def run_columns(conn: Connection) -> str:
    """RUN_COLUMNS for ``SELECT … FROM runs``: on a lake, compute_s is the sum over the run's
    stored batches (``LAKE_COMPUTE_S``), which ingest does not add to the run's row."""
    if db.has_keys(conn):
        return RUN_COLUMNS
    summed = LAKE_COMPUTE_S.format(t="runs")
    return RUN_COLUMNS.replace("compute_s,", f"greatest(compute_s, {summed}) AS compute_s,")


@dataclass(frozen=True)
class Run:
    run_id: int
    run_key: str
    name: str
    corpus: str
    corpus_fingerprint: str
    model: str
    model_name: str
    n_layers: int
    n_heads: int
    d_head: int
    params: dict
    seq_len: int
    short_range: int
    engine: str
    device: str | None
    status: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    compute_s: float
    wall_s: float
    error: str | None

    @classmethod
    def from_row(cls, row) -> Run:
        data = dict(row._mapping)
        if isinstance(data["params"], str):
            data["params"] = json.loads(data["params"])
        return cls(**data)


now = db.now


class Store:
    """The results database (``db``: a path, a ``ducklake:…`` URL, or a backend). Every read and
    write of the results goes through it or through the functions below on one of its
    transactions; ``at``: read the database as of that snapshot (a lake)."""

    def __init__(self, path: str | Path | Backend, *, data_path: str | Path | None = None, at: int | None = None):
        self.backend = open_backend(path, data_path=data_path)
        self.at = at
        # a file's path (what tests and tools expect); a lake is named by its label
        self.path: Path | str = getattr(self.backend, "path", None) or self.backend.label

    def __str__(self) -> str:
        return self.backend.label

    # --- sessions -------------------------------------------------------------------------
    def write(self):
        return db.transaction(self.backend)

    def atomically(self, work):
        """``work(conn)`` in one write transaction, tried again when a lake refuses the commit
        for a concurrent change (``db.atomically``)."""
        return db.atomically(self.backend, work)

    def read(self):
        return db.transaction(self.backend, read_only=True, at=self.at)

    def ensure_schema(self) -> None:
        db.ensure_schema(self.backend)

    def checked_read(self):
        """A read transaction on a database whose schema is current."""
        return db.checked_read(self.backend, at=self.at)

    def snapshot(self, conn: Connection) -> int | None:
        """The snapshot a read transaction of this store sees (None: a file, which keeps none)."""
        return self.backend.snapshot_of(conn)

    # --- runs -----------------------------------------------------------------------------
    def find_or_create_run(
        self,
        *,
        run_key: str,
        name: str,
        corpus: str,
        corpus_fingerprint: str,
        model: dict,
        params: dict,
        engine: str,
        device: str | None,
        alias: str | None = None,
    ) -> tuple[Run, bool]:
        """The run with this key, or a new one named ``name``. Returns (run, created).

        ``alias``: the name the caller asked for. A run found under another name gets it as an
        alias (``run_aliases``), so that the name asked for resolves to the run that holds the
        results; a name that another run holds is refused.
        """
        values = {
            "run_key": run_key,
            "name": name,
            "corpus": corpus,
            "fp": corpus_fingerprint,
            "model": model["spec"],
            "model_name": model["name"],
            "n_layers": model["layers"],
            "n_heads": model["heads"],
            "d_head": model["d_head"],
            "params": json.dumps(params),
            "seq_len": params["seq_len"],
            "short_range": params["short_range"],
            "engine": engine,
            "device": device,
            "created_at": now(),
        }

        def work(conn: Connection) -> tuple[Run, bool]:
            keys = db.has_keys(conn)
            if not keys:
                db.serialize(conn)  # two writers opening one run (or two runs named alike) take turns
            row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_key = :k"), {"k": run_key}).first()
            if row is not None:
                run = Run.from_row(row)
                if alias is not None and alias != run.name:
                    owner = run_labels.owner_of(conn, alias)
                    if owner is not None and owner != run.run_id:
                        raise StoreError(
                            f"run name {alias!r} is taken by run {owner}, and run {run.run_id} ({run.name}) already "
                            "holds this corpus, model and parameters: pass another --name, or leave it out"
                        )
                    run_labels.add_alias(conn, run.run_id, alias)
                return run, False
            if run_labels.owner_of(conn, name) is not None:
                raise StoreError(
                    f"run name {name!r} is taken by a run with other corpus, model or parameters: pass another --name"
                )
            columns = (
                "run_key, name, corpus, corpus_fingerprint, model, model_name, n_layers, n_heads, d_head, params, "
                "seq_len, short_range, engine, device, status, created_at"
            )
            given = (
                ":run_key, :name, :corpus, :fp, :model, :model_name, :n_layers, :n_heads, :d_head, :params, "
                ":seq_len, :short_range, :engine, :device, 'created', :created_at"
            )
            if keys:
                row = conn.execute(
                    text(f"INSERT INTO runs ({columns}) VALUES ({given}) RETURNING {RUN_COLUMNS}"), values
                ).first()
            else:  # no sequence on a lake: the next id, taken under serialize (above)
                run_id = int(conn.execute(text("SELECT coalesce(max(run_id), 0) + 1 FROM runs")).scalar_one())
                conn.execute(
                    text(f"INSERT INTO runs (run_id, {columns}, compute_s, wall_s) VALUES (:run_id, {given}, 0, 0)"),
                    {**values, "run_id": run_id},
                )
                row = conn.execute(
                    text(f"SELECT {run_columns(conn)} FROM runs WHERE run_id = :r"), {"r": run_id}
                ).first()
            return Run.from_row(row), True

        return self.atomically(work)

    def set_status(
        self,
        run_id: int,
        status: str,
        *,
        error: str | None = None,
        started: bool = False,
        finished: bool = False,
        add_wall_s: float = 0.0,
    ) -> None:
        sets = ["status = :status", "error = :error", "wall_s = wall_s + :wall"]
        if started:
            sets.append("started_at = coalesce(started_at, :ts)")
        if finished:
            sets.append("finished_at = :ts")

        def work(conn: Connection) -> None:
            conn.execute(
                text(f"UPDATE runs SET {', '.join(sets)} WHERE run_id = :run_id"),
                {"status": status, "error": error, "ts": now(), "run_id": run_id, "wall": add_wall_s},
            )

        self.atomically(work)

    def get_run(self, ref: str | int | None = None) -> Run:
        with self.checked_read() as conn:
            return resolve_run(conn, ref)

    def list_runs(self, *, tags: tuple[str, ...] = ()) -> list[dict]:
        """Every run (with ``tags``: those that have all of them), with its ``aliases`` and
        ``tags`` (lists)."""
        with self.checked_read() as conn:
            keys = db.has_keys(conn)
            compute = "r.compute_s" if keys else f"greatest(r.compute_s, {LAKE_COMPUTE_S.format(t='r')})"
            # a lake: the last snapshot that changed the run (its row, its ledger, its probe): what
            # `--at` reads to see the run as it is now
            snapshot = "" if keys else f", {LAST_SNAPSHOT} AS snapshot"
            rows = (
                conn.execute(
                    text(
                        "SELECT r.run_id, r.name, r.status, r.model_name AS model, r.corpus, "
                        f"coalesce(c.windows, 0) AS windows, {compute} AS compute_s, r.wall_s, r.created_at, "
                        f"r.finished_at{snapshot} FROM runs r LEFT JOIN chance_totals c USING (run_id) ORDER BY r.run_id"
                    )
                )
                .mappings()
                .all()
            )
            labels = run_labels.labels(conn)
        out = []
        for row in rows:
            aliases, tagged = labels.get(row["run_id"], ([], []))
            if all(t in tagged for t in tags):
                out.append({**row, "aliases": aliases, "tags": tagged})
        return out

    def rename_run(self, ref: str | int, new: str) -> tuple[Run, str]:
        """Give the run ``ref`` names the name ``new``; returns (the run renamed, its old name)."""
        with self.write() as conn:
            run = resolve_run(conn, ref)
            old = run_labels.rename(conn, run.run_id, new)
            return resolve_run(conn, run.run_id), old

    def tag_run(self, ref: str | int, add: list[str], remove: list[str]) -> tuple[Run, list[str], list[str]]:
        """Add and remove tags; returns (the run, tags added, tags removed)."""
        with self.write() as conn:
            run = resolve_run(conn, ref)
            return run, run_labels.tag(conn, run.run_id, add), run_labels.untag(conn, run.run_id, remove)

    def delete_run(self, run_id: int) -> dict[str, int]:
        """Delete a run and all its rows in one transaction (``run_labels.delete``); on a lake,
        tried again when a writer storing the run committed first (``run_is_there``)."""

        def work(conn: Connection) -> dict[str, int]:
            resolve_run(conn, run_id)  # still there
            return run_labels.delete(conn, run_id)

        return self.atomically(work)

    def done_window_ids(self, run_id: int) -> set[str]:
        with self.read() as conn:
            rows = conn.execute(text("SELECT window_id FROM run_windows WHERE run_id = :r"), {"r": run_id})
            return {r[0] for r in rows}

    def next_batch_id(self, run_id: int) -> int:
        with self.read() as conn:
            return int(
                conn.execute(
                    text("SELECT coalesce(max(batch_id), -1) + 1 FROM batches WHERE run_id = :r"), {"r": run_id}
                ).scalar()
            )

    def compact(self, run_id: int) -> dict[str, tuple[int, int]]:
        """Fold the run's partial sums into one row set (views unchanged, queries faster)."""
        from headatlas.service.storage.compact import compact_run

        return self.atomically(lambda conn: compact_run(conn, run_id))

    def mixing_windows(self, run_id: int) -> int:
        """Windows of this run that already carry mixing measures (for the --attribution-windows cap)."""
        with self.read() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT coalesce(sum(windows), 0) FROM mixing_stats "
                        "WHERE run_id = :r AND method = 'attention' AND layer = 0 AND head = -1"
                    ),
                    {"r": run_id},
                ).scalar()
            )

    # --- the synthetic probe (SPEC §8) ----------------------------------------------------
    def effect_windows(self, run_id: int) -> int:
        """Windows of this run that already carry causal effects (for the --effect-windows cap)."""
        from headatlas.service.storage.effect_rows import effect_windows

        with self.read() as conn:
            return effect_windows(conn, run_id)

    def probe_of(self, run_id: int) -> tuple[int, int, int] | None:
        """The stored probe's (length, sequences, seed), or None when the run has none."""
        with self.read() as conn:
            return probe_spec(conn, run_id)

    def store_probe(self, run_id: int, spec: tuple[int, int, int], scores: dict[str, np.ndarray]) -> bool:
        """Store the run's probe scores (``scores``: name -> ``[layer, head]``) in one transaction.
        One probe per run: the same probe stored again is skipped (returns False), another one
        (other length, sequences or seed) replaces it."""
        return self.atomically(lambda conn: store_probe(conn, run_id, spec, scores))

    # --- ingest ---------------------------------------------------------------------------
    def ingest(self, run_id: int, items: list[tuple[int, BatchResult]]) -> int:
        """Store batch results in one transaction. A batch already stored is skipped (so a
        redelivered batch is harmless); returns the number of batches newly stored."""
        return store_batches(self, run_id, items)


def resolve_run(conn: Connection, ref: str | int | None, *, any_status: bool = False) -> Run:
    """A run by id, name or alias; ``ref`` None: the default run (``pick_run``), or with
    ``any_status`` the latest run whatever its status (what ``headatlas status`` watches)."""
    if ref is None and any_status:
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs ORDER BY run_id DESC LIMIT 1")).first()
        if row is None:
            raise RunNotFound("no runs yet: run `headatlas analyze CORPUS` first")
        return Run.from_row(row)
    return pick_run(conn, ref)[0]


def pick_run(conn: Connection, ref: str | int | None) -> tuple[Run, str | None]:
    """The run ``ref`` names (id, name or alias), or by default the latest finished run that is
    not a random-weights control; with a note to show when the run is not finished, or when a
    later run is still in progress and was passed over (None otherwise)."""
    if ref is None:
        return _default_run(conn)
    ref_s = str(ref)
    if ref_s.isdigit():
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_id = :r"), {"r": int(ref_s)}).first()
    else:
        row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE name = :r"), {"r": ref_s}).first()
        if row is None and (aliased := run_labels.run_by_alias(conn, ref_s)) is not None:
            row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_id = :r"), {"r": aliased}).first()
    if row is None:
        raise RunNotFound(f"no run {ref_s!r}: see `headatlas runs` for ids and names")
    run = Run.from_row(row)
    return run, None if run.status == "done" else _unfinished(conn, run)


def _default_run(conn: Connection) -> tuple[Run, str | None]:
    # controls (analyze --control) are stored after their run: the latest run would be a control
    rows = conn.execute(
        text(
            f"SELECT {run_columns(conn)} FROM runs ORDER BY json_extract(params, '$.control_of') IS NOT NULL, run_id DESC"
        )
    ).all()
    if not rows:
        raise RunNotFound("no runs yet: run `headatlas analyze CORPUS` first")
    runs = [Run.from_row(r) for r in rows]
    latest = runs[0]
    if latest.status == "done":
        return latest, None
    done = next((r for r in runs if r.status == "done" and _is_control(r) == _is_control(latest)), None)
    if done is None:
        return latest, _unfinished(conn, latest)
    return done, (
        f"run {latest.run_id} ({latest.name}) is {latest.status}; showing the latest finished run, "
        f"{done.run_id} ({done.name}): pass --run {latest.run_id} for the other's results so far"
    )


def _is_control(run: Run) -> bool:
    return "control_of" in run.params


def _unfinished(conn: Connection, run: Run) -> str:
    windows = conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run.run_id}).scalar()
    if run.status in run_labels.UNFINISHED:
        state = "in progress"
    else:
        state = f"{run.status}, not finished (re-run its command to resume)"
    return f"run {run.run_id} ({run.name}) is {state}: results so far, from {windows:,} windows"


def probe_spec(conn: Connection, run_id: int) -> tuple[int, int, int] | None:
    row = conn.execute(
        text("SELECT length, sequences, seed FROM probe_scores WHERE run_id = :r LIMIT 1"), {"r": run_id}
    ).first()
    return None if row is None else (int(row[0]), int(row[1]), int(row[2]))


def store_probe(conn: Connection, run_id: int, spec: tuple[int, int, int], scores: dict[str, np.ndarray]) -> bool:
    """See ``Store.store_probe``; the writer of a distributed run calls this inside its transaction."""
    if probe_spec(conn, run_id) == tuple(spec):
        return False
    conn.execute(text("DELETE FROM probe_scores WHERE run_id = :r"), {"r": run_id})
    values = {name: np.asarray(v, dtype=np.float64) for name, v in scores.items()}
    n_layers, n_heads = values["induction_score"].shape
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    length, sequences, seed = spec
    table = pa.table(
        {
            "run_id": np.full(layer.size, run_id, dtype=np.int32),
            "layer": layer.ravel().astype(np.int16),
            "head": head.ravel().astype(np.int16),
            "length": np.full(layer.size, length, dtype=np.int32),
            "sequences": np.full(layer.size, sequences, dtype=np.int32),
            "seed": np.full(layer.size, seed, dtype=np.int64),
            **{name: v.ravel() for name, v in values.items()},
        }
    )
    raw = db.driver_connection(conn)
    raw.register("_in_probe_scores", table)
    try:
        conn.exec_driver_sql("INSERT INTO probe_scores BY NAME SELECT * FROM _in_probe_scores")
    finally:
        raw.unregister("_in_probe_scores")
    return True


Unreserved = db.Unreserved


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
                    "SELECT :r, batch_id, 0, 'reserved', 0 FROM _in_reserved"
                ),
                {"r": run_id},
            )
        finally:
            raw.unregister("_in_reserved")
    return len(missing)


def run_is_there(conn: Connection, run_id: int, run_key: str, *, hold: bool = False) -> bool:
    """Whether run ``run_id`` is still in the database under ``run_key``: `runs delete` may have
    deleted it while a writer stores it (and a lake may give its id to a new run). ``hold``, on a
    lake, in the transaction that reserves the run's batches: the run's row is rewritten too, so
    that this transaction and a concurrent delete of the run conflict; the delete, tried again,
    sees the reservations and deletes them, and a store of them then conflicts with it in turn:
    no batch is stored into a run deleted meanwhile."""
    args = {"r": run_id, "k": run_key}
    if hold and not db.has_keys(conn):
        conn.execute(text("UPDATE runs SET status = status WHERE run_id = :r AND run_key = :k"), args)
    return bool(conn.execute(text("SELECT count(*) FROM runs WHERE run_id = :r AND run_key = :k"), args).scalar())


def store_batches(store: Store, run_id: int, items: list[tuple[int, BatchResult]]) -> int:
    """``ingest_batches`` in its own transaction, exactly once on any backend: on a lake the
    batches are reserved first, and a commit refused for a concurrent store of the same batch
    is tried again (it then finds the batch stored and skips it)."""
    ids = [b for b, _ in items]
    for _ in range(db.CONFLICT_TRIES):
        try:
            return store.atomically(lambda conn: ingest_batches(conn, run_id, items))
        except Unreserved as exc:
            store.atomically(lambda conn, missing=exc.batch_ids: reserve_batches(conn, run_id, missing))
    raise StoreError(f"run {run_id}: batches {ids} could not be reserved for storing; try again")


# compute_s of a run on a lake: the sum over its stored batches (a per-batch update of the run's
# row would make every two writers of one run conflict)
LAKE_COMPUTE_S = (
    "(SELECT coalesce(sum(b.compute_s), 0) FROM batches b WHERE b.run_id = {t}.run_id AND b.status = 'done')"
)


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
    done = {b for b, status in ledger if status == "done"}
    fresh = [(b, res) for b, res in items if b not in done]
    fresh_ids = [b for b, _ in fresh]
    if not keys:
        held = sorted({b for b, status in ledger if status != "done"})
        unreserved = [b for b in fresh_ids if b not in held]
        if unreserved:
            raise Unreserved(unreserved)
        # every row but a done one goes: the reservations of the batches stored now, and those of
        # batches already stored, which a writer committed after reading the ledger before another
        # writer stored them (a writer stopped inside its reservation): one row per batch, always
        if held:
            conn.execute(
                text(
                    "DELETE FROM batches WHERE run_id = :r AND status <> 'done' AND batch_id IN "
                    "(SELECT unnest(CAST(:ids AS INTEGER[])))"
                ),
                {"r": run_id, "ids": held},
            )
    if not fresh:
        return []
    raw = db.driver_connection(conn)
    tables = _arrow_tables(run_id, fresh)
    tables.update(mixing_tables(run_id, fresh))
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
            "run_chance",
            "dist_hist",
            "pair_hist",
            "anchors",
            "anchor_tokens",
            "anchor_layers",
            "csm_bins",
        ):
            if name in tables:
                conn.exec_driver_sql(f"INSERT INTO {name} BY NAME SELECT * FROM _in_{name}")
        for name in MIXING_TABLES:
            if name in tables:
                conn.exec_driver_sql(f"INSERT INTO {name} BY NAME SELECT * FROM _in_{name}")
        # what the batches' causal effects are measured against (SPEC §9)
        insert_run_effects(conn, run_id, [res.effects for _, res in fresh])
        if keys:
            conn.exec_driver_sql(
                "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts, compute_s, ingested_at) "
                "SELECT run_id, batch_id, n_windows, 'done', 1, compute_s, now() FROM _in_batches "
                "ON CONFLICT (run_id, batch_id) DO UPDATE SET status = 'done', compute_s = excluded.compute_s, "
                "ingested_at = excluded.ingested_at, error = NULL"
            )
            conn.execute(
                text("UPDATE runs SET compute_s = compute_s + :s WHERE run_id = :r"),
                {"s": float(sum(res.compute_s for _, res in fresh)), "r": run_id},
            )
        else:  # the batches' rows deleted above; compute_s is summed from here when read
            conn.exec_driver_sql(
                "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts, compute_s, ingested_at) "
                "SELECT run_id, batch_id, n_windows, 'done', 1, compute_s, now() FROM _in_batches"
            )
    finally:
        for name in tables:
            raw.unregister(f"_in_{name}")
    return fresh_ids


def _arrow_tables(run_id: int, items: list[tuple[int, BatchResult]]) -> dict[str, pa.Table]:
    rows = TableRows()
    add = rows.add

    # a column left out of an insert is NULL ("unavailable"): a payload made before the per-distance
    # within-sentence counts existed must not make the others' sum look whole
    with_sentence = all(res.rep_same_sentence_hist is not None for _, res in items)
    # the declared sums (service.metrics) that every payload carries; one made before a sum
    # existed leaves its column NULL for the whole insert
    head_sums = [k for k in HEAD_SUMS if all(k in res.rep_heads for _, res in items)]
    run_sums = [k for k in CHANCE_SUMS if all(k in res.rep_chance for _, res in items)]
    for batch_id, res in items:
        # every additive sum is stored per replicate group (column rep, SPEC §5b)
        n_groups, n_layers, n_heads = res.rep_heads["high_pairs"].shape
        group, layer, head = np.meshgrid(np.arange(n_groups), np.arange(n_layers), np.arange(n_heads), indexing="ij")
        add(
            "head_stats",
            run_id=np.full(layer.size, run_id),
            batch_id=np.full(layer.size, batch_id),
            rep=res.reps[group],
            layer=layer,
            head=head,
            **{k: res.rep_heads[k] for k in head_sums},
        )
        add(
            "run_chance",
            run_id=np.full(n_groups, run_id),
            batch_id=np.full(n_groups, batch_id),
            rep=res.reps,
            **{k: res.rep_chance[k] for k in run_sums},
            csm_windows=res.rep_chance["windows"] * (res.csm_sum is not None),
        )
        gi, li, hi, di = np.nonzero(res.rep_dist_hist)
        same = res.rep_same_sentence_hist  # not None in any item when with_sentence
        sentence = {"same_sentence": same[gi, li, hi, di]} if with_sentence and same is not None else {}
        add(
            "dist_hist",
            run_id=np.full(li.size, run_id),
            batch_id=np.full(li.size, batch_id),
            rep=res.reps[gi],
            layer=li,
            head=hi,
            distance=di,
            count=res.rep_dist_hist[gi, li, hi, di],
            attended=res.rep_attended_hist[gi, li, hi, di],
            **sentence,
        )
        if res.csm_sum is not None:
            assert res.csm_count is not None  # a batch has both sums and counts, or neither
            # cells holding pairs only: the upper triangle, and few cells of H per batch
            ki, lc, hc, bi, bj = np.nonzero(res.csm_count)
            add(
                "csm_bins",
                run_id=np.full(ki.size, run_id),
                batch_id=np.full(ki.size, batch_id),
                layer=lc,
                head=hc,
                kind=np.array(CSM_KINDS, dtype=object)[ki],
                bin_i=bi,
                bin_j=bj,
                sim_sum=res.csm_sum[ki, lc, hc, bi, bj].astype(np.float64),
                pairs=res.csm_count[ki, lc, hc, bi, bj].astype(np.int64),
            )
        gp, dp = np.nonzero(res.rep_pair_hist["pairs"])
        add(
            "pair_hist",
            run_id=np.full(dp.size, run_id),
            batch_id=np.full(dp.size, batch_id),
            rep=res.reps[gp],
            distance=dp,
            count=res.rep_pair_hist["pairs"][gp, dp],
            **{k: res.rep_pair_hist[k][gp, dp] for k in PAIR_HISTS if k != "pairs"},
        )
        wi, la, he = np.nonzero(res.anchor_token >= 0)
        token_ids = res.anchor_token[wi, la, he]
        high = res.high_count[wi, la, he]
        count = res.anchor_count[wi, la, he]
        window_ids = np.array(res.window_ids, dtype=object)
        add(
            "anchors",
            run_id=np.full(wi.size, run_id),
            window_id=window_ids[wi],
            layer=la,
            head=he,
            token_id=token_ids,
            token=np.array([res.vocab.get(int(t), str(t)) for t in token_ids], dtype=object),
            endpoint_count=count,
            high_pairs=high,
            anchor_share=count / np.maximum(2 * high, 1),
            anchor_is_frequent=res.anchor_frequent[wi, la, he],
        )
        n_layers = res.anchor_token.shape[1]
        share = count / np.maximum(2 * high, 1)
        tok_layer, tok_head, tok_id, tok_windows, tok_share = anchor_token_sums(res.anchor_token, la, he, wi, share)
        add(
            "anchor_tokens",
            run_id=np.full(tok_id.size, run_id),
            batch_id=np.full(tok_id.size, batch_id),
            layer=tok_layer,
            head=tok_head,
            token_id=tok_id,
            token=np.array([res.vocab.get(int(t), str(t)) for t in tok_id], dtype=object),
            windows=tok_windows,
            share_sum=tok_share,
        )
        lay_windows, lay_distinct, lay_anchors, lay_heads = anchor_layer_sums(res.anchor_token)
        add(
            "anchor_layers",
            run_id=np.full(n_layers, run_id),
            batch_id=np.full(n_layers, batch_id),
            layer=np.arange(n_layers),
            windows=lay_windows,
            distinct_windows=lay_distinct,
            distinct_anchor_sum=lay_anchors,
            anchored_head_sum=lay_heads,
        )
        add(
            "run_windows",
            run_id=np.full(len(res.window_ids), run_id),
            window_id=window_ids,
            batch_id=np.full(len(res.window_ids), batch_id),
        )
        add("batches", run_id=[run_id], batch_id=[batch_id], n_windows=[len(res.window_ids)], compute_s=[res.compute_s])
        add(
            "windows",
            window_id=[w["window_id"] for w in res.windows],
            doc_id=[w["doc_id"] for w in res.windows],
            window_index=[w["window_index"] for w in res.windows],
            n_tokens=[w["n_tokens"] for w in res.windows],
        )
        docs = res.documents
        add(
            "documents",
            doc_id=[d["doc_id"] for d in docs],
            source=[d["source"] for d in docs],
            line=[d["line"] for d in docs],
            n_chars=[d["n_chars"] for d in docs],
            preview=[d["preview"] for d in docs],
        )
    return rows.tables()


def anchor_token_sums(anchor_token: np.ndarray, layer, head, window, share):
    """Per (layer, head, token): windows where it is the anchor, and the sum of anchor_share.

    anchor_token: ``[window, layer, head]``; layer/head/window/share: the anchored entries.
    """
    n_heads = anchor_token.shape[2]
    token = anchor_token[window, layer, head]
    key = (layer.astype(np.int64) * n_heads + head) * (int(token.max(initial=0)) + 1) + token
    uniq, inverse = np.unique(key, return_inverse=True)
    windows = np.bincount(inverse, minlength=uniq.size)
    share_sum = np.bincount(inverse, weights=share, minlength=uniq.size)
    vocab = int(token.max(initial=0)) + 1
    return (uniq // vocab) // n_heads, (uniq // vocab) % n_heads, uniq % vocab, windows, share_sum


def anchor_layer_sums(anchor_token: np.ndarray):
    """Per layer: windows with an anchored head, windows whose anchored heads all differ,
    and the sums of distinct anchors and of anchored heads (for the mean distinct ratio)."""
    ordered = np.sort(anchor_token, axis=2)  # [window, layer, head], -1 (no anchor) first
    anchored = ordered >= 0
    repeat = (ordered[..., 1:] == ordered[..., :-1]) & anchored[..., 1:]
    n_anchored = anchored.sum(2)
    n_distinct = n_anchored - repeat.sum(2)
    has = n_anchored > 0
    return (has.sum(0), (has & (n_distinct == n_anchored)).sum(0), n_distinct.sum(0), n_anchored.sum(0))
