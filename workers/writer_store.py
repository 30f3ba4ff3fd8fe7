"""The writer's own database: the one it opened at start, never a new one.

A database file can be moved, deleted or replaced under a running writer; creating a new one at
its path would drop every analysed batch that waits in Redis for the old one. So every
transaction of the writer first checks that the file at the path is still its database (same
file, or the same database id), and raises ``DatabaseAway`` (a ``StoreBusy``: the messages stay
in Redis) when it is not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import HeadatlasError, StoreBusy, StoreError
from headatlas.service.storage.db import has_table
from headatlas.service.storage.store import Store


class DatabaseAway(StoreBusy):
    """The writer's database file is missing, or the file at its path is another database: the
    writer waits for its own (messages stay in Redis, as for a busy file)."""


def file_database_id(path) -> str | None:
    """The id of the headatlas database ``path`` (a path, a ``ducklake:…`` URL or a backend);
    None when there is none, or it holds no headatlas database (empty, another tool's,
    unreadable). Reads only; never creates."""
    from headatlas.service.storage import db
    from headatlas.service.storage.backends import open_backend

    backend = open_backend(path)
    try:
        if not backend.exists():
            return None
        with db.transaction(backend, read_only=True, create=False) as conn:
            return _id_in(conn)
    except HeadatlasError:
        return None


def _id_in(conn: Connection) -> str | None:
    if not has_table(conn, "database_info"):
        return None
    return conn.execute(text("SELECT value FROM database_info WHERE key = 'database_id'")).scalar()


class _Created(Exception):
    """The writer's own open created an empty database at its path (``ident``: that file)."""

    def __init__(self, ident):
        super().__init__("created")
        self.ident = ident


class OwnStore(Store):
    """The writer's database: only the file it opened at start, never a new one. A transaction
    on a missing file, or on a file that now holds another database (moved, deleted, replaced
    under the writer), raises DatabaseAway before anything is written."""

    def __init__(self, path, database_id: str):
        super().__init__(path)
        self.database_id = database_id
        self._files = self.backend.identity() is not None  # a lake has no file to move away
        self._ident = self._stat()

    def _stat(self):
        return self.backend.identity()

    def check(self) -> None:
        if not self._files:
            return
        ident = self._stat()
        if ident is None:
            raise DatabaseAway(self._away("missing (moved or deleted)"))
        if ident != self._ident:  # another file at the path: the same database put back, or not
            found = file_database_id(self.backend)
            if found != self.database_id:
                raise DatabaseAway(
                    self._away(f"now {'database ' + found[:8] if found else 'not a headatlas database'}")
                )
            self._ident = ident

    def _away(self, what: str) -> str:
        return (
            f"database {self.backend.label} is {what}: this writer stores into database {self.database_id[:8]} and never "
            "creates another one while runs are in flight; analysed batches wait in Redis until that database "
            f"is back at {self.backend.label}"
        )

    @contextmanager
    def _guarded(self, *, read_only: bool = False) -> Iterator[Connection]:
        from headatlas.service.storage import db

        self.check()
        try:
            with db.transaction(self.backend, read_only=read_only, create=False) as conn:
                found = _id_in(conn)
                if found != self.database_id:
                    if found is None and self._files and self._made_by_open(conn):
                        raise _Created(self._stat())
                    raise DatabaseAway(self._away(f"now {'database ' + found[:8] if found else 'another file'}"))
                yield conn
        except _Created as created:
            self._remove_created(created.ident)
            raise DatabaseAway(self._away("missing (moved or deleted)")) from None
        except DatabaseAway:
            raise
        except StoreBusy:
            raise  # busy, or a lake's commit conflict: tried again
        except StoreError:
            if self._files and self._stat() != self._ident:  # the file went away while it was being opened
                raise DatabaseAway(self._away("missing (moved or deleted)")) from None
            raise

    def _made_by_open(self, conn: Connection) -> bool:
        """Whether the connection just opened is on an empty database that the open itself created:
        the file was moved away between the check and DuckDB's open, which creates a missing file
        even for this writer (seen in a test that renames the file while the writer stores)."""
        if self._stat() == self._ident:
            return False
        return not conn.execute(text("SELECT count(*) FROM information_schema.tables")).scalar()

    def _remove_created(self, ident) -> None:
        """Remove the empty database this writer's open created at the path (and its WAL), only
        while the path still holds that very file: the path is left as the move left it."""
        import os

        path = self.backend.path  # type: ignore[attr-defined]  # _files: a file backend
        if ident is None or self._stat() != ident:
            return
        for leftover in (path, f"{path}.wal"):
            try:
                os.remove(leftover)
            except FileNotFoundError:
                pass

    def write(self):
        return self._guarded()

    def read(self):
        """Through the guard too: a read (open_run of a run already opened, a group's summary)
        on a file just moved away is the writer's pause, not an error told to the run's
        submitter (seen: `submit --wait` ended with "no database at ..." while the writer
        waited for the file)."""
        return self._guarded(read_only=True)

    @contextmanager
    def checked_read(self) -> Iterator[Connection]:
        from headatlas.service.storage import db

        with self._guarded(read_only=True) as conn:
            db.check_schema(conn, self.backend)
            yield conn

    def atomically(self, work):
        """As Store's, through the guard: a run opened or a group stored just after the file was
        moved away must not create an empty database at its path (seen: `open_run` did, and failed
        on the missing tables, while the writer never paused)."""
        from headatlas.service.storage import db

        return db.atomically(self.backend, work, session=self._guarded)
