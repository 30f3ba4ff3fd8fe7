"""Database access: one helper scopes every unit of work, connections are short-lived.

DuckDB lets one process hold a file read-write, and while it does no other process may open it
at all. So every unit of work opens the file, does its work in one transaction, and closes it:
the lock is held for milliseconds, and other processes (a writer, ``query``, ``status``) wait
for it with ``retry_on_lock`` instead of failing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from headatlas.service.errors import DatabaseFileError, StoreBusy, StoreError
from headatlas.service.storage import dbfile
from headatlas.service.storage.readonly import MAX_RETRY_DELAY_S, retry_on_lock

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
LOCK_WAIT_S = 30.0
# DuckDB refuses a read-only and a read-write connection to one file in one process at once:
# threads of one process (beat's tick and the fires it runs) open the file in turn.
_PROCESS_LOCK = threading.RLock()


def driver_connection(conn: Connection) -> Any:
    """The DuckDB connection under ``conn`` (to register Arrow tables on it)."""
    raw = conn.connection.driver_connection
    assert raw is not None  # only a closed or invalidated connection has none, and conn is open
    return raw


def make_engine(path: str | Path, *, read_only: bool = False) -> Engine:
    # absolute: DuckDB reads a leading "name:" as an extension's protocol (an:x/c.duckdb)
    return create_engine(
        f"duckdb:///{Path(path).absolute()}",
        poolclass=NullPool,
        connect_args={"read_only": read_only} if read_only else {},
    )


@contextmanager
def transaction(
    path: str | Path, *, read_only: bool = False, lock_wait_s: float | None = None, create: bool = True
) -> Iterator[Connection]:
    """Open the database, yield a connection inside a transaction; commit on success, roll
    back on error, always close (releasing the file lock).

    The file is checked first (dbfile.check_file); DuckDB's own failures on a damaged file, at
    open or while reading, become a DatabaseFileError. ``create=False``: a missing file is an
    error, never a new empty database (the queue's writer, whose file may be moved away)."""
    dbfile.check_file(path, write=not read_only, create=create)
    engine = make_engine(path, read_only=read_only)
    try:
        with _connected(engine, path, LOCK_WAIT_S if lock_wait_s is None else lock_wait_s) as conn:
            try:
                with conn.begin():
                    yield conn
            except Exception as exc:
                raise dbfile.open_error(path, exc) or exc  # noqa: B904 - the error or its translation
    finally:
        engine.dispose()


@contextmanager
def _connected(engine: Engine, path: str | Path, lock_wait_s: float) -> Iterator[Connection]:
    """A connection, with this process's lock held while it is open. Waiting for another
    process's file lock happens outside it, so this process's other threads are not held up."""
    deadline, delay = time.monotonic() + lock_wait_s, 0.05
    while True:
        with _PROCESS_LOCK:
            conn = _connect(engine, path, 0)
            if conn is not None:
                try:
                    yield conn
                finally:
                    conn.close()
                return
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreBusy(
                f"{path} is busy: another process is writing to it and held its lock for more than "
                f"{lock_wait_s:g} s; retry when that process finishes"
            )
        time.sleep(min(delay, left))
        delay = min(delay * 2, MAX_RETRY_DELAY_S)


def _connect(engine: Engine, path: str | Path, lock_wait_s: float) -> Connection | None:
    """A connection, or None when the file stayed locked for ``lock_wait_s``; DuckDB's failures
    on a damaged file become a DatabaseFileError."""
    try:
        return retry_on_lock(engine.connect, wait_s=lock_wait_s, what=str(path))
    except StoreBusy:
        return None
    except Exception as exc:
        raise dbfile.open_error(path, exc) or exc  # noqa: B904 - the error or its translation


@contextmanager
def checked_read(path: str | Path, *, lock_wait_s: float = LOCK_WAIT_S) -> Iterator[Connection]:
    """A read-only transaction on a database whose schema is current (every read path uses it)."""
    with transaction(path, read_only=True, lock_wait_s=lock_wait_s) as conn:
        check_schema(conn, path)
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
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(_alembic_config())


def _alembic_config():
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    return config


def current_revision(conn: Connection) -> str | None:
    exists = conn.execute(
        text("SELECT count(*) FROM information_schema.tables WHERE table_name = 'alembic_version'")
    ).scalar()
    if not exists:
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(path: str | Path) -> tuple[str | None, str]:
    """Apply pending migrations. Returns (revision before, revision after)."""
    from alembic import command

    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DatabaseFileError(
            f"cannot create the folder of {path} ({exc.strerror}); pass --db in a writable folder"
        ) from None
    check_headatlas_file(path)
    engine = make_engine(path)
    try:
        with _connected(engine, path, LOCK_WAIT_S) as conn:
            before = current_revision(conn)
            check_known(before, path)
            config = _alembic_config()
            config.attributes["connection"] = conn
            command.upgrade(config, "head")
            conn.commit()
            after = current_revision(conn)
            assert after is not None  # alembic_version now holds the head it upgraded to
            return before, after
    finally:
        engine.dispose()


def check_schema(conn: Connection, path: str | Path) -> None:
    """Refuse to work on a database whose schema is not the current head."""
    check_not_foreign(conn, path)
    current, head = current_revision(conn), head_revision()
    check_known(current, path)
    if current != head:
        raise StoreError(
            f"database {path} has schema {current or 'none'}, this headatlas needs {head}: run `headatlas db upgrade`"
        )


def check_known(current: str | None, path: str | Path) -> None:
    """Refuse a schema revision this headatlas does not know and `db upgrade` could not migrate:
    a newer headatlas's (a higher number than this one's head), or another tool's alembic
    history. An unknown lower number falls through to the usual stale-schema error."""
    if current is None or current == head_revision() or known_revision(current):
        return
    number, head = current.split("_", 1)[0], head_revision().split("_", 1)[0]
    if not number.isdigit():
        raise DatabaseFileError(
            f"database {path} has schema revision {current!r}, which is not headatlas's (another tool's alembic "
            "history?): pass another --db; headatlas reads and writes only its own databases"
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


def check_headatlas_file(path: str | Path) -> None:
    """Refuse to write into a file that is not a headatlas database: damaged, not DuckDB, or a
    DuckDB database with other tables and no headatlas schema. A missing file or an empty
    DuckDB database passes (the schema is created in it). Reads only."""
    dbfile.check_file(path, write=True)
    if not Path(path).exists():
        return
    with transaction(path, read_only=True) as conn:
        check_not_foreign(conn, path)


def check_not_foreign(conn: Connection, path: str | Path) -> None:
    """Refuse a DuckDB database that holds tables but no headatlas schema (another tool's)."""
    if current_revision(conn) is None and _has_tables(conn):
        raise DatabaseFileError(
            f"{path} is a DuckDB database of something else (tables but no headatlas schema): "
            "pass another --db; headatlas reads and writes only its own databases"
        )


def ensure_schema(path: str | Path) -> None:
    """Create the schema in a new database; refuse a stale existing one, and any file that is
    not a headatlas database."""
    check_headatlas_file(path)
    if not Path(path).exists():
        upgrade(path)
        return
    with transaction(path) as conn:
        if current_revision(conn) is None:
            pass  # an empty DuckDB database (checked above): safe to create the schema below
        else:
            check_schema(conn, path)
            return
    upgrade(path)


def _has_tables(conn: Connection) -> bool:
    return bool(conn.execute(text("SELECT count(*) FROM information_schema.tables")).scalar())


def database_id(conn: Connection) -> str:
    """The random id this database was given at creation (migration 0005): state kept outside
    the file on its behalf (broker keys, a writer's lease) is scoped by it."""
    return conn.execute(text("SELECT value FROM database_info WHERE key = 'database_id'")).scalar_one()


def read_database_id(path: str | Path) -> str:
    """The id of the database at ``path``, read-only; a stale schema is refused first."""
    with transaction(path, read_only=True) as conn:
        check_schema(conn, path)
        return database_id(conn)
