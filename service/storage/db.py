"""Database access: one helper scopes every unit of work, on whichever backend holds the results.

``transaction(db)`` and ``checked_read(db)`` take a database as the user named it (a path, a
``ducklake:…`` URL) or a ``Backend`` (``service/storage/backends``): the backend decides how a
connection is opened and held. An embedded file is opened for each unit of work and closed after
it, so that its lock is held for milliseconds (other processes wait for it with
``retry_on_lock``); a lake is attached once per process and every unit of work gets its own
connection to it. The rest of this module (schema checks, migrations, identity) is the same for
every backend.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from headatlas.service.errors import DatabaseFileError, Param, StoreConflict, StoreError
from headatlas.service.storage.backends import Backend, label, open_backend
from headatlas.service.storage.backends.file import PROCESS_LOCK as _PROCESS_LOCK  # noqa: F401 - kept importable

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
LOCK_WAIT_S = 30.0
CONFLICT_TRIES = 20  # a unit of work a lake refused for a concurrent change is tried this often
T = TypeVar("T")

Target = str | Path | Backend


def backend_of(db: Target) -> Backend:
    return open_backend(db)


def has_table(conn: Connection, name: str) -> bool:
    """Whether the current database's main schema holds the table ``name``. DuckDB's catalogue
    function, not information_schema.tables (a view over it and the views' catalogue): 1.2 ms a
    call against 5.6 ms on a headatlas file, and a writer asks at every transaction."""
    found = conn.execute(
        text(
            "SELECT count(*) FROM duckdb_tables() WHERE table_name = :name "
            "AND schema_name = 'main' AND database_name = current_database()"
        ),
        {"name": name},
    ).scalar()
    return bool(found)


def has_keys(conn: Connection) -> bool:
    """Whether the database under ``conn`` enforces keys (PRIMARY KEY, UNIQUE, ON CONFLICT,
    sequences, RETURNING on inserts): an embedded file does, a lake does not. Asked once per
    connection."""
    info = conn.connection.info
    if "headatlas_keys" not in info:
        kind = conn.execute(
            text("SELECT type FROM duckdb_databases() WHERE database_name = current_database()")
        ).scalar()
        info["headatlas_keys"] = kind != "ducklake"
    return bool(info["headatlas_keys"])


def serialize(conn: Connection) -> None:
    """On a lake: make this transaction conflict with every other one that calls this, so that
    read-then-insert (a new run's id, a unique name) cannot interleave; the loser's commit is
    refused and ``atomically`` tries it again on the winner's state. DuckLake refuses a commit
    that deletes a row another committed transaction deleted, and an UPDATE deletes the old row.
    Nothing on an embedded file, whose keys and sequences do this."""
    if not has_keys(conn):
        conn.execute(text("UPDATE database_info SET value = value WHERE key = 'database_id'"))


def next_id(conn: Connection, table: str, column: str) -> int:
    """The next id of ``table`` on a lake (no sequences there): one past the largest, read under
    ``serialize`` so that two writers never take the same."""
    serialize(conn)
    return int(conn.execute(text(f"SELECT coalesce(max({column}), 0) + 1 FROM {table}")).scalar_one())


def driver_connection(conn: Connection) -> Any:
    """The DuckDB connection under ``conn`` (to register Arrow tables on it)."""
    raw = conn.connection.driver_connection
    assert raw is not None  # only a closed or invalidated connection has none, and conn is open
    return raw


def make_engine(path: Target, *, read_only: bool = False) -> Engine:
    """An engine on an embedded file (migration tests drive Alembic through it)."""
    from headatlas.service.storage.backends.file import FileBackend

    backend = backend_of(path)
    assert isinstance(backend, FileBackend)
    return backend.engine(read_only=read_only)


@contextmanager
def transaction(
    db: Target,
    *,
    read_only: bool = False,
    lock_wait_s: float | None = None,
    create: bool = True,
    at: int | None = None,
) -> Iterator[Connection]:
    """A connection inside one transaction on ``db``: committed on success, rolled back on error,
    always closed. ``create=False``: a missing database is an error, never a new empty one (the
    queue's writer, whose file may be moved away). ``at``: as of that snapshot (a lake)."""
    backend = backend_of(db)
    with backend.transaction(
        read_only=read_only, lock_wait_s=LOCK_WAIT_S if lock_wait_s is None else lock_wait_s, create=create, at=at
    ) as conn:
        yield conn


class Unreserved(StoreConflict):
    """On a lake, a batch without a ledger row was about to be stored: reserve it first
    (``store.reserve_batches``), then store it again."""

    def __init__(self, batch_ids: list[int]):
        super().__init__(f"batches {batch_ids} have no ledger row to claim yet; they are reserved and stored again")
        self.batch_ids = batch_ids


def atomically(
    db: Target,
    work: Callable[[Connection], T],
    *,
    tries: int = CONFLICT_TRIES,
    session: Callable[[], AbstractContextManager[Connection]] | None = None,
) -> T:
    """``work(conn)`` in one write transaction, tried again when a lake refuses the commit for a
    concurrent change to the same rows (the next try sees that change). An embedded file never
    refuses one: its single writer is serialised by the file lock. ``session``: what opens the
    transaction (default ``transaction(db)``; the queue's writer passes one that never creates a
    database)."""
    delay = 0.02
    for attempt in range(tries):
        try:
            with (session or (lambda: transaction(db)))() as conn:
                return work(conn)
        except Unreserved:
            raise  # the caller reserves, then tries again
        except StoreConflict:
            if attempt == tries - 1:
                raise
            time.sleep(delay * (1 + random.random()))
            delay = min(delay * 2, 1.0)
    raise AssertionError("unreachable")  # the loop returns or raises


@contextmanager
def checked_read(db: Target, *, lock_wait_s: float = LOCK_WAIT_S, at: int | None = None) -> Iterator[Connection]:
    """A read-only transaction on a database whose schema is current (every read path uses it)."""
    backend = backend_of(db)
    with transaction(backend, read_only=True, lock_wait_s=lock_wait_s, at=at) as conn:
        check_schema(conn, backend, at=at)
        yield conn


def now() -> datetime:
    """UTC now, naive: how every timestamp is stored."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def record(row, *, json_fields: tuple[str, ...] = ()) -> dict:
    """A result row as a dict, with JSON columns parsed (DuckDB returns them as text)."""
    data = dict(row._mapping)
    for name in json_fields:
        if isinstance(data.get(name), str):
            data[name] = json.loads(data[name])
    return data


@lru_cache(maxsize=1)
def head_revision() -> str:
    return _script().get_current_head()


def _script():
    with _quiet_alembic():
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(_alembic_config())


def _alembic_config():
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def current_revision(conn: Connection) -> str | None:
    """The database's schema revision, None where it has none (a new or another tool's database).
    Read directly, asked by every transaction that checks the schema: looking the table up in
    DuckDB's catalogue first (``duckdb_tables()``) cost four times the read. A table not found
    leaves DuckDB's transaction usable: ``_migrate`` creates a new database's schema in the
    connection that found none, on a file and on a lake alike."""
    import duckdb
    from sqlalchemy.exc import DBAPIError

    try:
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError as exc:
        if isinstance(exc.orig, duckdb.CatalogException):
            return None
        raise


def upgrade(db: Target) -> tuple[str | None, str]:
    """Apply pending migrations. Returns (revision before, revision after)."""
    backend = backend_of(db)
    backend.prepare()
    check_headatlas_file(backend)
    return _upgrade(backend)


def _upgrade(backend: Backend) -> tuple[str | None, str]:
    with _quiet_alembic():
        from alembic import command

        with backend.session(lock_wait_s=LOCK_WAIT_S) as conn:
            return _migrate(command, conn, backend)


def _migrate(command, conn: Connection, backend: Backend) -> tuple[str | None, str]:
    before = current_revision(conn)
    check_known(before, backend)
    conn.commit()  # end the read's transaction: alembic begins its own (a lake: one per migration)
    config = _alembic_config()
    config.attributes["connection"] = conn
    config.attributes["keys"] = backend.keys
    command.upgrade(config, "head")
    conn.commit()
    after = current_revision(conn)
    assert after is not None  # alembic_version now holds the head it upgraded to
    return before, after


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic says each step it takes at INFO ("Context impl …", "Running upgrade …", about 20
    lines for a new database), and a writer or beat logging at INFO would print them all at
    start: they are kept to warnings unless headatlas logs at DEBUG (``--loglevel debug``)."""
    log = logging.getLogger("alembic")
    before = log.level
    if before == logging.NOTSET and not logging.getLogger("headatlas").isEnabledFor(logging.DEBUG):
        log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(before)


def check_schema(conn: Connection, path: Target, *, at: int | None = None) -> None:
    """Refuse to work on a database whose schema is not the current head. ``at``: the snapshot
    read; one older than the head schema is not upgraded (`db upgrade` changes the current
    database, never a past snapshot): a later snapshot is read instead."""
    path = label(path)
    current, head = current_revision(conn), head_revision()
    _refuse_foreign(conn, path, current)
    check_known(current, path)
    if current != head and at is not None:
        raise StoreError(
            f"snapshot {at} of {path} predates schema {head} (it holds schema {current or 'none'}); this headatlas "
            "reads snapshots at that schema or later: pass a later --at (`headatlas runs` shows each run's "
            "snapshot) or leave --at out to read the current state"
        )
    if current != head:
        raise StoreError(
            f"database {path} has schema {current or 'none'}, this headatlas needs {head}: run `headatlas db upgrade`"
        )


def check_known(current: str | None, path: Target) -> None:
    """Refuse a schema revision this headatlas does not know and `db upgrade` could not migrate:
    a newer headatlas's (a higher number than this one's head), or another tool's alembic
    history. An unknown lower number falls through to the usual stale-schema error."""
    if current is None or current == head_revision() or known_revision(current):
        return
    path = label(path)
    number, head = current.split("_", 1)[0], head_revision().split("_", 1)[0]
    if not number.isdigit():
        raise DatabaseFileError(
            f"database {path} has schema revision {current!r}, which is not headatlas's (another tool's alembic "
            "history?): pass another ",
            Param("db"),
            "; headatlas reads and writes only its own databases",
        )
    if head.isdigit() and int(number) > int(head):
        raise StoreError(
            f"database {path} was written by a newer headatlas (schema {current}; this one knows up to "
            f"{head_revision()}): upgrade headatlas to use it"
        )


@lru_cache(maxsize=64)
def known_revision(revision: str) -> bool:
    """Whether ``revision`` is one of this headatlas's migrations (else a newer headatlas's, or
    another tool's alembic history)."""
    from alembic.util import CommandError

    try:
        return _script().get_revision(revision) is not None
    except (CommandError, KeyError, ValueError):
        return False


def check_headatlas_file(db: Target) -> None:
    """Refuse to write into a database that is not a headatlas database: damaged, not DuckDB, or
    a DuckDB database with other tables and no headatlas schema. A missing file or an empty
    database passes (the schema is created in it). Reads only."""
    backend = backend_of(db)
    backend.check(write=True)
    if not backend.exists():
        return
    with transaction(backend, read_only=True) as conn:
        check_not_foreign(conn, backend.label)


def check_not_foreign(conn: Connection, path: Target) -> None:
    """Refuse a database that holds tables but no headatlas schema (another tool's)."""
    _refuse_foreign(conn, path, current_revision(conn))


def _refuse_foreign(conn: Connection, path: Target, current: str | None) -> None:
    if current is None and _has_tables(conn):
        raise DatabaseFileError(
            f"{label(path)} is a DuckDB database of something else (tables but no headatlas schema): pass another ",
            Param("db"),
            "; headatlas reads and writes only its own databases",
        )


def ensure_schema(db: Target) -> None:
    """Create the schema in a new database; refuse a stale existing one, and any database that is
    not a headatlas database."""
    backend = backend_of(db)
    check_headatlas_file(backend)
    if not backend.exists():
        from headatlas.service.storage import new_file

        new_file.create(backend, head_revision(), upgrade)  # a copy of a migrated one, from the second on
        return
    with transaction(backend) as conn:
        if current_revision(conn) is None:
            pass  # an empty database (checked above): safe to create the schema below
        else:
            check_schema(conn, backend)
            return
    upgrade(backend)


def _has_tables(conn: Connection) -> bool:
    return bool(
        conn.execute(
            text("SELECT count(*) FROM information_schema.tables WHERE table_catalog = current_database()")
        ).scalar()
    )


def database_id(conn: Connection) -> str:
    """The random id this database was given at creation (migration 0005): state kept outside
    the file on its behalf (broker keys, a writer's lease) is scoped by it."""
    return conn.execute(text("SELECT value FROM database_info WHERE key = 'database_id'")).scalar_one()


def read_database_id(db: Target) -> str:
    """The id of the database ``db``, read-only; a stale schema is refused first."""
    with checked_read(db) as conn:
        return database_id(conn)
