"""Copy a whole results database to another backend (``headatlas db copy SRC DST``): a file into a
lake, a lake into a file, or between two of either kind.

The target is created at the current schema (or must be one, holding no runs and no schedules);
the source is attached read-only to a connection of the target, and every table's rows are
inserted in one transaction, so a copy that fails leaves the target as it was. The target keeps
its own database id (state kept outside a database, in Redis, is scoped by it). Each table is
then counted on both sides: the copy is verified, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from headatlas.service.errors import ParameterError, StoreError
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
        connection.execute("BEGIN")
        try:
            for table in tables:
                names = ", ".join(columns[table])
                connection.execute(f"INSERT INTO {table} ({names}) SELECT {names} FROM copy_source.main.{table}")
            if target.keys:
                for sequence, (table, column) in SEQUENCES.items():
                    # ids the copy brought must not be handed out again
                    connection.execute(
                        f"SELECT max(nextval('{sequence}')) FROM range((SELECT max({column}) FROM {table}))"
                    )
            connection.execute("COMMIT")
        except Exception:
            connection.execute("ROLLBACK")
            raise
        counts = [
            Copied(
                table,
                int(connection.execute(f"SELECT count(*) FROM copy_source.main.{table}").fetchone()[0]),  # type: ignore[index]
                int(connection.execute(f"SELECT count(*) FROM {table}").fetchone()[0]),  # type: ignore[index]
            )
            for table in tables
        ]
    finally:
        connection.close()
    wrong = [c for c in counts if c.source != c.target]
    if wrong:
        listed = ", ".join(f"{c.table} {c.source} → {c.target}" for c in wrong)
        raise StoreError(f"db copy: counts differ after the copy ({listed})")
    return counts
