"""Every table of one run, written as Parquet or CSV files by DuckDB's ``COPY``.

Tables keyed by run_id are filtered by it; ``windows`` and ``documents`` (shared between runs)
keep the rows the run references. A ``manifest.json`` lists the files with their row counts.

The export opens its own read-only DuckDB connection. It cannot use the locked-down one of
``headatlas sql`` (``storage.readonly.connect_readonly``): that one disables file access on
purpose, and COPY … TO writes files. Only fixed statements built here run on this connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from headatlas.service.errors import ParameterError, StoreError
from headatlas.service.storage.readonly import retry_on_lock

if TYPE_CHECKING:
    from headatlas.service.storage.store import Run

FORMATS = ("parquet", "csv")
# table → rows of run :run (a validated integer, inlined: COPY takes no parameters)
RUN_TABLES = {
    "runs": "SELECT * FROM runs WHERE run_id = {run}",
    "batches": "SELECT * FROM batches WHERE run_id = {run}",
    "run_windows": "SELECT * FROM run_windows WHERE run_id = {run}",
    "windows": "SELECT * FROM windows WHERE window_id IN (SELECT window_id FROM run_windows WHERE run_id = {run})",
    "documents": (
        "SELECT * FROM documents WHERE doc_id IN (SELECT w.doc_id FROM windows w "
        "JOIN run_windows r USING (window_id) WHERE r.run_id = {run})"
    ),
    "head_stats": "SELECT * FROM head_stats WHERE run_id = {run}",
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
    db_path: str | Path, run_ref: str | int | None, fmt: str, out_dir: str | Path, *, lock_wait_s: float = 30.0
) -> tuple[Run, list[ExportedTable]]:
    """Write every table of the run to ``out_dir/<table>.<fmt>`` and a manifest.

    Returns (run, exported tables). The database is only read."""
    from headatlas.service.storage.store import Store

    if fmt not in FORMATS:
        raise ParameterError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    store = Store(db_path)
    with store.checked_read() as conn:  # checks the schema and resolves the run
        from headatlas.service.storage.store import resolve_run

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
    connection = retry_on_lock(
        lambda: duckdb.connect(str(db_path), read_only=True), wait_s=lock_wait_s, what=f"the database {db_path}"
    )
    try:
        for table in RUN_TABLES:
            path = out / f"{table}.{fmt}"
            query = table_query(table, run.run_id)
            try:
                connection.execute(f"COPY ({query}) TO {_literal(path)} ({options})")
                count = connection.execute(f"SELECT count(*) FROM ({query})").fetchone()
                assert count is not None  # count(*) always returns one row
                rows = count[0]
            except duckdb.IOException as error:
                raise StoreError(f"cannot write {path}: {str(error).splitlines()[0]}; check --out") from None
            exported.append(ExportedTable(table, path, int(rows)))
    finally:
        connection.close()
    manifest = {
        "run_id": run.run_id,
        "name": run.name,
        "model": run.model_name,
        "params": run.params,
        "format": fmt,
        "exported_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "database": str(Path(db_path).resolve()),
        "tables": {t.table: {"file": t.path.name, "rows": t.rows} for t in exported},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return run, exported


def _literal(path: Path) -> str:
    return "'" + str(path).replace("'", "''") + "'"
