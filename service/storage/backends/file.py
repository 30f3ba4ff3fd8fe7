"""The embedded backend: one DuckDB file on this machine's disk.

DuckDB lets one process hold a file read-write, and while it does no other process may open it
at all. So every unit of work opens the file, does its work in one transaction, and closes it:
the lock is held for milliseconds, and other processes (a writer, ``query``, ``status``) wait
for it with ``retry_on_lock`` instead of failing. Opening is attaching the file to a DuckDB
instance this process keeps between transactions, closing is detaching it (file_instances).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from headatlas.service.errors import DatabaseFileError, Param, Placeholder, StoreBusy
from headatlas.service.storage import dbfile
from headatlas.service.storage.backends.base import Backend
from headatlas.service.storage.backends.file_instances import connect as attached_connection
from headatlas.service.storage.duckdb_settings import READONLY_CONFIG, duckdb_config
from headatlas.service.storage.locks import MAX_RETRY_DELAY_S, retry_on_lock

# DuckDB refuses a read-only and a read-write connection to one file in one process at once:
# threads of one process (beat's tick and the fires it runs) open the file in turn, and a file's
# header is read only while no connection of this process is open on it (dbfile: reading it beside
# one dropped DuckDB's lock). Reset in a forked child (dbfile).
PROCESS_LOCK = dbfile.PROCESS_LOCK

# Opening a file costs about 8 ms of CPU on a kept instance (the catalogue read; 15 ms with an
# instance of its own), closing it a checkpoint: a run's start and end are a dozen transactions back
# to back. Within ``held()`` the file stays attached and each transaction is a new connection on its
# instance (``cursor``), in every thread of this process; no other process can open the file
# meanwhile, so a hold covers transactions with no work between them, never a run's batches. Keyed
# by the absolute path; the hold's own connection.
_HELD: dict[str, Any] = {}
# a forked child must neither use nor close (checkpoint) its parent's instance: it forgets the holds,
# and the connections are kept referenced there, never closed by the child's garbage collector
_FORKED: list[Any] = []


def _forget_holds() -> None:
    _FORKED.extend(_HELD.values())
    _HELD.clear()
    _ENGINES_LOCK._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_forget_holds)

# engines kept between transactions, by file and read-only (most recently used last)
_ENGINES: dict[tuple[str, bool], Engine] = {}
_ENGINES_KEPT = 16
_ENGINES_LOCK = threading.Lock()


def _new_engine(backend: FileBackend, read_only: bool) -> Engine:
    from duckdb_engine import ConnectionWrapper

    return create_engine(
        "duckdb://", creator=lambda: ConnectionWrapper(backend.connect(read_only=read_only)), poolclass=NullPool
    )


class FileBackend(Backend):
    kind = "file"
    confines_sql = True  # read-only, external access off, configuration locked (sandbox)

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.url = str(path)

    @property
    def label(self) -> str:
        return str(self.path)

    def check(self, *, write: bool, create: bool = True) -> None:
        dbfile.check_file(self.path, write=write, create=create)

    def exists(self) -> bool:
        return self.path.is_file()

    def prepare(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise DatabaseFileError(
                f"cannot create the folder of {self.path} ({exc.strerror})",
                hint=("pass ", Param("db"), " in a writable folder"),
            ) from None

    def local_folder(self) -> Path:
        return self.path.absolute().parent

    def identity(self) -> tuple[int, int] | None:
        return dbfile.file_key(self.path)

    def connect(self, *, read_only: bool = False, config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
        # absolute: DuckDB reads a leading "name:" as an extension's protocol (an:x/c.duckdb)
        where = str(self.path.absolute())
        if not config:  # on an instance kept between transactions (file_instances); read-only too where held
            return attached_connection(where, read_only=read_only)
        return duckdb.connect(where, read_only=read_only, config=duckdb_config(**config))

    @contextmanager
    def held(self) -> Iterator[None]:
        """This file's DuckDB instance kept open while inside (``_HELD``); nested holds share the
        outer one. Nothing is held where the file does not exist yet (a new database is made by
        ``ensure_schema``), or cannot be opened for writing now (busy, read-only, damaged): each
        transaction then opens it and reports as before."""
        where = str(self.path.absolute())
        key = None
        with PROCESS_LOCK:
            if where in _HELD or not self.path.is_file():
                conn = None
            else:
                try:
                    conn = attached_connection(where, read_only=False)
                except Exception:  # noqa: BLE001 - an optimisation: the transactions open it themselves
                    conn = None
                else:
                    _HELD[where] = conn
                    key = dbfile.opened(self.path)
        try:
            yield
        finally:
            if conn is not None:
                with PROCESS_LOCK:
                    _HELD.pop(where, None)
                    try:
                        conn.close()
                    finally:
                        dbfile.closed(key)

    def engine(self, *, read_only: bool = False) -> Engine:
        """An engine on the file, kept for the next transaction on it (a new engine costs about 3 ms
        of CPU, its dialect set up afresh); each connection it makes is new (no pool)."""
        key = (str(self.path.absolute()), read_only)
        with _ENGINES_LOCK:
            engine = _ENGINES.pop(key, None)
            if engine is None:
                engine = _new_engine(FileBackend(key[0]), read_only)
            _ENGINES[key] = engine  # the most recently used last
            while len(_ENGINES) > _ENGINES_KEPT:
                del _ENGINES[next(iter(_ENGINES))]
        return engine

    @contextmanager
    def transaction(
        self,
        *,
        read_only: bool = False,
        lock_wait_s: float | None = None,
        create: bool = True,
        at: int | None = None,
    ) -> Iterator[Connection]:
        """The file is checked first (dbfile.check_file); DuckDB's own failures on a damaged file,
        at open or while reading, become a DatabaseFileError. ``create=False``: a missing file is
        an error, never a new empty database (the queue's writer, whose file may be moved away)."""
        if at is not None:
            from headatlas.service.errors import ParameterError

            raise ParameterError(
                Param("at", at),
                f": {self.label} is an embedded DuckDB file, which keeps no snapshots",
                hint=("snapshots are kept by a lake (", Param("db", Placeholder("ducklake:…")), ")"),
            )
        self.check(write=not read_only, create=create)
        engine = self.engine(read_only=read_only)
        with self.connected(engine, 30.0 if lock_wait_s is None else lock_wait_s) as conn:
            try:
                with conn.begin():
                    yield conn
            except Exception as exc:
                # DuckDB refused the commit (or a statement) on another process's lock, e.g. on
                # the .wal file: rolled back, nothing written, DatabaseLocked (the caller retries)
                raise self.translate(exc) or exc  # noqa: B904 - the error or its translation

    @contextmanager
    def session(self, *, lock_wait_s: float | None = None) -> Iterator[Connection]:
        with self.connected(self.engine(), 30.0 if lock_wait_s is None else lock_wait_s) as conn:
            yield conn

    @contextmanager
    def connected(self, engine: Engine, lock_wait_s: float) -> Iterator[Connection]:
        """A connection, with this process's lock held while it is open. Waiting for another
        process's file lock happens outside it, so this process's other threads are not held up."""
        deadline, delay = time.monotonic() + lock_wait_s, 0.05
        while True:
            with PROCESS_LOCK:
                conn = self._connect(engine)
                if conn is not None:
                    key = dbfile.opened(self.path)
                    try:
                        yield conn
                    finally:
                        try:
                            conn.close()
                        finally:
                            dbfile.closed(key)
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreBusy(
                    f"{self.label} is busy: another process is writing to it and held its lock for more than "
                    f"{lock_wait_s:g} s; retry when that process finishes"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, MAX_RETRY_DELAY_S)

    def _connect(self, engine: Engine) -> Connection | None:
        """A connection, or None while the file is locked by another process; DuckDB's failures
        on a damaged file become a DatabaseFileError."""
        try:
            return retry_on_lock(engine.connect, wait_s=0, what=self.label)
        except StoreBusy:
            return None
        except Exception as exc:
            raise self.translate(exc) or exc  # noqa: B904 - the error or its translation

    def translate(self, exc: BaseException) -> Exception | None:
        return dbfile.translate(self.path, exc)

    @contextmanager
    def sandbox(
        self, *, limits: dict[str, str] | None = None, lock_wait_s: float = 10.0, at: int | None = None
    ) -> Iterator[duckdb.DuckDBPyConnection]:
        """The file read-only with external access disabled, extension autoload/autoinstall off
        and the configuration locked."""
        if at is not None:
            with self.transaction(read_only=True, at=at):
                pass  # raises: a file keeps no snapshots
        self.check(write=False)
        try:
            connection = retry_on_lock(
                lambda: self.connect(read_only=True, config={**(limits or {}), **READONLY_CONFIG}),
                wait_s=lock_wait_s,
                what=f"the database {self.label}",
            )
        except duckdb.Error as error:
            raise self.translate(error) or error  # noqa: B904 - the error or its translation
        try:
            yield connection
        finally:
            connection.close()

    def attach_sql(self, alias: str, *, read_only: bool) -> list[str]:
        path = str(self.path.absolute()).replace("'", "''")
        return [f"ATTACH '{path}' AS {alias}" + (" (READ_ONLY)" if read_only else "")]

    def maintain(self, **options: Any) -> dict[str, Any]:
        """A file reclaims its free blocks on checkpoint: that is all there is to do."""
        self.check(write=True, create=False)
        before = self.path.stat().st_size
        with self.session() as conn:
            conn.execute(text("CHECKPOINT"))
        return {"bytes_before": before, "bytes_after": self.path.stat().st_size}
