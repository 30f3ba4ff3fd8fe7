"""Copy a whole results database to another backend (``headatlas db copy SRC DST``): a file into a
lake, a lake into a file, or between two of either kind.

The target is created at the current schema (or must be one, holding no runs and no schedules);
the source is attached read-only to a connection of the target, and every table's rows are
inserted in one transaction, so a copy that fails leaves the target as it was. A lake has no keys,
and writers that interleave can leave a key there twice; a file's keys take it once (the stored
batch over a reservation beside it). The target keeps
its own database id (state kept outside a database, in Redis, is scoped by it). Each table is
then counted on both sides: the copy is verified, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
from sqlalchemy import text

from headatlas.service.errors import ParameterError, StoreError
from headatlas.service.statuses import BatchStatus, sql
from headatlas.service.storage import db
from headatlas.service.storage.backends import Backend, open_backend

# rows that belong to the database itself, not to its results
OWN_TABLES = ("alembic_version", "database_info")
# sequences of a file (a lake has none) and the column whose ids they hand out
SEQUENCES = {"run_id_seq": ("runs", "run_id"), "schedule_id_seq": ("schedules", "schedule_id")}


@dataclass(frozen=True)
class Copied:
    table: str
    source: int
    target: int


def copy_database(src: str | Backend, dst: str | Backend) -> list[Copied]:
    """Copy every run, schedule and their rows from ``src`` into ``dst``; returns the row counts
    of both sides per table (equal, or StoreError)."""
    source, target = open_backend(src), open_backend(dst)
    if source.label == target.label:
        raise ParameterError(f"db copy: source and target are both {source.label}; pass two databases")
    with db.checked_read(source):
        pass  # a headatlas database at the current schema
    db.ensure_schema(target)
    with db.checked_read(target) as conn:
        held = conn.execute(text("SELECT (SELECT count(*) FROM runs) + (SELECT count(*) FROM schedules)")).scalar()
        if held:
            raise ParameterError(
                f"db copy: {target.label} already holds runs or schedules; copy into a new database "
                "(a new file, or a lake with an empty catalogue)"
            )
        tables = [
            r[0]
            for r in conn.execute(
                text(
                    "SELECT table_name FROM information_schema.tables WHERE table_catalog = current_database() "
                    "AND table_type = 'BASE TABLE' ORDER BY table_name"
                )
            )
            if r[0] not in OWN_TABLES
        ]
    connection = target.connect()
    try:
        source.prepare_connection(connection)
        for statement in source.attach_sql("copy_source", read_only=True):
            connection.execute(statement)
        columns = {
            t: [
                r[0]
                for r in connection.execute(
                    "SELECT column_name FROM information_schema.columns WHERE table_catalog = current_database() "
                    "AND table_name = ? ORDER BY ordinal_position",
                    [t],
                ).fetchall()
            ]
            for t in tables
        }
        keys = _primary_keys(connection) if target.keys else {}
        connection.execute("BEGIN")
        try:
            for table in tables:
                names = ", ".join(columns[table])
                connection.execute(
                    f"INSERT INTO {table} ({names}) SELECT {names} FROM {_source_rows(table, keys.get(table))}"
                )
            if target.keys:
                for sequence, (table, column) in SEQUENCES.items():
                    # ids the copy brought must not be handed out again
                    connection.execute(
                        f"SELECT max(nextval('{sequence}')) FROM range((SELECT max({column}) FROM {table}))"
                    )
            # counted in the copy's own transaction: the source as the copy read it (a lake's writer
            # may commit a finished run's stored results between the copy and a later count)
            counts = [
                Copied(table, _count(connection, _source_rows(table, keys.get(table))), _count(connection, table))
                for table in tables
            ]
            connection.execute("COMMIT")
        except duckdb.Error as exc:
            connection.execute("ROLLBACK")
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise StoreError(
                f"db copy: {target.label} refused the rows of {table} ({first}); nothing was copied"
            ) from None
        except Exception:
            connection.execute("ROLLBACK")
            raise
    finally:
        connection.close()
    wrong = [c for c in counts if c.source != c.target]
    if wrong:
        listed = ", ".join(f"{c.table} {c.source} → {c.target}" for c in wrong)
        raise StoreError(f"db copy: counts differ after the copy ({listed})")
    return counts


def _count(connection, rows: str) -> int:
    """``SELECT count(*)`` of a table or of a subquery's rows."""
    return int(connection.execute(f"SELECT count(*) FROM {rows}").fetchone()[0])


def _primary_keys(connection) -> dict[str, list[str]]:
    """The target's tables with a primary key, and its columns (a file's; a lake has none)."""
    rows = connection.execute(
        "SELECT table_name, constraint_column_names FROM duckdb_constraints() "
        "WHERE constraint_type = 'PRIMARY KEY' AND database_name = current_database()"
    ).fetchall()
    return {table: list(names) for table, names in rows}


def _source_rows(table: str, key: list[str] | None) -> str:
    """The source's rows of ``table`` as the target takes them: one per primary key. A lake has
    no keys, and writers that interleave may leave a key twice (a batch's reservation beside the
    row that stored it, a window two writers first stored at once): the stored batch is kept,
    and content-addressed rows are equal."""
    source = f"copy_source.main.{table}"
    if not key:
        return source
    prefer = f"(status = {sql(BatchStatus.DONE)}) DESC, " if table == "batches" else ""
    partition = ", ".join(key)
    return (
        f"(SELECT * EXCLUDE (_copy_rank) FROM (SELECT *, row_number() OVER (PARTITION BY {partition} "
        f"ORDER BY {prefer}{partition}) AS _copy_rank FROM {source}) WHERE _copy_rank = 1)"
    )
