"""The results store: the one entry point to a results database. Each method opens one
transaction (or reads in one) and calls the module that knows its tables:

- runs.py: the runs table (a run's row, its status, finding a run by id, name or alias);
- ingest.py: storing batch results exactly once, and what a run has stored already
  (``store_batches``, below, stores them in transactions of their own);
- probes.py: a run's synthetic probe scores;
- run_labels.py: names, aliases, tags, deleting a run.

The writer of a distributed run calls those modules' functions inside its own transactions; the
names below stay importable from here for every caller.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from sqlalchemy.engine import Connection

from headatlas.service.engine.results import BatchResult
from headatlas.service.errors import StoreError
from headatlas.service.statuses import RunStatus
from headatlas.service.storage import db, ingest, probes, run_labels, runs
from headatlas.service.storage.backends import Backend, open_backend
from headatlas.service.storage.batch_rows import anchor_layer_sums, anchor_token_sums
from headatlas.service.storage.ingest import (
    Unreserved,
    ingest_batch_ids,
    ingest_batches,
    reserve_batches,
)
from headatlas.service.storage.probes import probe_spec, store_probe
from headatlas.service.storage.runs import (
    LAKE_COMPUTE_S,
    LAST_SNAPSHOT,
    RUN_COLUMNS,
    Run,
    now,
    pick_run,
    resolve_run,
    run_columns,
    run_is_there,
)

__all__ = [
    "LAKE_COMPUTE_S",
    "LAST_SNAPSHOT",
    "RUN_COLUMNS",
    "Run",
    "Store",
    "Unreserved",
    "anchor_layer_sums",
    "anchor_token_sums",
    "ingest_batch_ids",
    "ingest_batches",
    "now",
    "pick_run",
    "probe_spec",
    "reserve_batches",
    "resolve_run",
    "run_columns",
    "run_is_there",
    "store_batches",
    "store_probe",
]


class Store:
    """The results database (``db``: a path, a ``ducklake:…`` URL, or a backend). Every read and
    write of the results goes through it or through the functions above on one of its
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

    def held(self):
        """Back-to-back transactions of this process share one opening of the database
        (``Backend.held``): a run's start and end, not its batches."""
        return self.backend.held()

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
        return self.atomically(lambda conn: runs.find_or_create(conn, values, alias=alias))

    def set_status(
        self,
        run_id: int,
        status: RunStatus | str,
        *,
        error: str | None = None,
        started: bool = False,
        finished: bool = False,
        add_wall_s: float = 0.0,
    ) -> None:
        self.atomically(
            lambda conn: runs.set_status(
                conn,
                run_id,
                RunStatus(status),
                error=error,
                started=started,
                finished=finished,
                add_wall_s=add_wall_s,
            )
        )

    def get_run(self, ref: str | int | None = None) -> Run:
        with self.checked_read() as conn:
            return resolve_run(conn, ref)

    def list_runs(self, *, tags: tuple[str, ...] = ()) -> list[dict]:
        """Every run (with ``tags``: those that have all of them), with its ``aliases`` and
        ``tags`` (lists)."""
        with self.checked_read() as conn:
            return runs.listed(conn, tags=tags)

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

    # --- what a run has stored (resuming it) ----------------------------------------------
    def done_window_ids(self, run_id: int) -> set[str]:
        with self.read() as conn:
            return ingest.done_window_ids(conn, run_id)

    def next_batch_id(self, run_id: int) -> int:
        with self.read() as conn:
            return ingest.next_batch_id(conn, run_id)

    def mixing_windows(self, run_id: int) -> int:
        """Windows of this run that already carry mixing measures (for the --attribution-windows cap)."""
        with self.read() as conn:
            return ingest.mixing_windows(conn, run_id)

    def compact(self, run_id: int) -> dict[str, tuple[int, int]]:
        """Fold the run's partial sums into one row set (views unchanged, queries faster)."""
        from headatlas.service.storage.compact import compact_run

        return self.atomically(lambda conn: compact_run(conn, run_id))

    # --- the synthetic probe (SPEC §8) ----------------------------------------------------
    def probe_of(self, run_id: int) -> tuple[int, int, int] | None:
        """The stored probe's (length, sequences, seed), or None when the run has none."""
        with self.read() as conn:
            return probe_spec(conn, run_id)

    def store_probe(self, run_id: int, spec: tuple[int, int, int], scores: dict[str, np.ndarray]) -> bool:
        """Store the run's probe scores (``scores``: name -> ``[layer, head]``) in one transaction.
        One probe per run: the same probe stored again is skipped (returns False), another one
        (other length, sequences or seed) replaces it."""
        return self.atomically(lambda conn: probes.store_probe(conn, run_id, spec, scores))

    # --- ingest ---------------------------------------------------------------------------
    def ingest(self, run_id: int, items: list[tuple[int, BatchResult]]) -> int:
        """Store batch results in one transaction. A batch already stored is skipped (so a
        redelivered batch is harmless); returns the number of batches newly stored."""
        return store_batches(self, run_id, items)


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
