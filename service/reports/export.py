"""Every table of one run, written as Parquet or CSV files by DuckDB's ``COPY``.

Tables keyed by run_id are filtered by it; ``windows`` and ``documents`` (shared between runs)
keep the rows the run references. A ``manifest.json`` lists the files with their row counts.

The export runs in one read transaction of the store (every table as of one state, on a lake
one snapshot). It cannot use the locked-down connection of ``headatlas sql``
(``storage.readonly.connect_readonly``): that one disables file access on purpose, and COPY … TO
writes files. Only fixed statements built here run on this connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
from sqlalchemy import exc as sa_exc

from headatlas.service.errors import ParameterError, StoreError

if TYPE_CHECKING:
    from headatlas.service.storage.store import Run

FORMATS = ("parquet", "csv")
# table → rows of run :run (a validated integer, inlined: COPY takes no parameters)
RUN_TABLES = {
    "runs": "SELECT * FROM runs WHERE run_id = {run}",
    "batches": "SELECT * FROM batches WHERE run_id = {run}",
    "run_windows": "SELECT * FROM run_windows WHERE run_id = {run}",
    # content-addressed rows shared between runs: once each (a lake, having no keys, may hold
    # one twice when two writers stored it at the same moment)
    "windows": (
        "SELECT DISTINCT ON (window_id) * FROM windows "
        "WHERE window_id IN (SELECT window_id FROM run_windows WHERE run_id = {run})"
    ),
    "documents": (
        "SELECT DISTINCT ON (doc_id) * FROM documents WHERE doc_id IN (SELECT w.doc_id FROM windows w "
        "JOIN run_windows r USING (window_id) WHERE r.run_id = {run})"
    ),
    "head_stats": "SELECT * FROM head_stats WHERE run_id = {run}",
    "named_head_sums": "SELECT * FROM named_head_sums WHERE run_id = {run}",
    "run_chance": "SELECT * FROM run_chance WHERE run_id = {run}",
    "dist_hist": "SELECT * FROM dist_hist WHERE run_id = {run}",
    "pair_hist": "SELECT * FROM pair_hist WHERE run_id = {run}",
    "anchors": "SELECT * FROM anchors WHERE run_id = {run}",
    "anchor_tokens": "SELECT * FROM anchor_tokens WHERE run_id = {run}",
    "anchor_layers": "SELECT * FROM anchor_layers WHERE run_id = {run}",
    "mixing_stats": "SELECT * FROM mixing_stats WHERE run_id = {run}",
    "mixing_dist": "SELECT * FROM mixing_dist WHERE run_id = {run}",
    "csm_bins": "SELECT * FROM csm_bins WHERE run_id = {run}",
    "probe_scores": "SELECT * FROM probe_scores WHERE run_id = {run}",
    "run_effects": "SELECT * FROM run_effects WHERE run_id = {run}",
    "prunes": "SELECT * FROM prunes WHERE run_id = {run}",
    "prune_curves": "SELECT * FROM prune_curves WHERE run_id = {run}",
    "streaming_effects": "SELECT * FROM streaming_effects WHERE run_id = {run}",
    "streaming_curves": "SELECT * FROM streaming_curves WHERE run_id = {run}",
    "streaming_curve_steps": "SELECT * FROM streaming_curve_steps WHERE run_id = {run}",
    "head_examples": "SELECT * FROM head_examples WHERE run_id = {run}",
    "example_windows": "SELECT * FROM example_windows WHERE run_id = {run}",
}


@dataclass(frozen=True)
class ExportedTable:
    table: str
    path: Path
    rows: int


def table_query(table: str, run_id: int) -> str:
    """The SELECT that gives ``table``'s rows of run ``run_id``, in a stable order."""
    return RUN_TABLES[table].format(run=int(run_id)) + " ORDER BY ALL"


def export_run(
    db_path: str | Path,
    run_ref: str | int | None,
    fmt: str,
    out_dir: str | Path,
    *,
    lock_wait_s: float = 30.0,
    at: int | None = None,
) -> tuple[Run, list[ExportedTable]]:
    """Write every table of the run to ``out_dir/<table>.<fmt>`` and a manifest.

    Returns (run, exported tables). The database is only read."""
    from headatlas.service.storage.store import Store

    if fmt not in FORMATS:
        raise ParameterError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    from headatlas.service.storage.store import resolve_run

    store = Store(db_path, at=at)
    with store.checked_read() as conn:  # checks the schema and resolves the run
        run = resolve_run(conn, run_ref)
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ParameterError(f"--out {out}: exists and is not a folder; pass a folder path")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ParameterError(
            f"--out {out}: cannot create the folder ({exc.strerror}); pass a writable folder"
        ) from None
    options = "FORMAT parquet, COMPRESSION zstd" if fmt == "parquet" else "FORMAT csv, HEADER true"
    exported = []
    with store.checked_read() as conn:  # every table as of one state
        for table in RUN_TABLES:
            path = out / f"{table}.{fmt}"
            query = table_query(table, run.run_id)
            try:
                conn.exec_driver_sql(f"COPY ({query}) TO {_literal(path)} ({options})")
                rows = conn.exec_driver_sql(f"SELECT count(*) FROM ({query})").scalar_one()
            except (duckdb.IOException, sa_exc.DBAPIError) as error:
                if isinstance(error, sa_exc.DBAPIError) and not isinstance(error.orig, duckdb.IOException):
                    raise
                first = str(getattr(error, "orig", error)).splitlines()[0]
                raise StoreError(f"cannot write {path}: {first}; check --out") from None
            exported.append(ExportedTable(table, path, int(rows)))
    manifest = {
        "run_id": run.run_id,
        "name": run.name,
        "model": run.model_name,
        "params": run.params,
        "format": fmt,
        "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "database": str(Path(db_path).resolve()) if store.backend.kind == "file" else store.backend.label,
        "tables": {t.table: {"file": t.path.name, "rows": t.rows} for t in exported},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return run, exported


def _literal(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"
