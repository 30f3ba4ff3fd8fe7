"""What every storage backend provides: one way to open a connection, and what it can do.

A backend is where the results live: an embedded DuckDB file (``file``), or a DuckLake (``lake``:
a catalogue in PostgreSQL or in a local file, table data as Parquet files in a folder). Everything
above ``service/storage`` sees only ``transaction()`` (a SQLAlchemy connection inside one
transaction, closed on exit) and the read-only sandbox of ``headatlas sql``; ``connect()`` —
the one place a DuckDB connection is opened — stays inside the storage package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import duckdb
from sqlalchemy.engine import Connection

from headatlas.service.storage.duckdb_settings import NO_DOWNLOADS, duckdb_config, extension_directory

__all__ = ["NO_DOWNLOADS", "Backend", "closing", "duckdb_config", "extension_directory"]


class Backend(ABC):
    """One database: where it is, how to open it, and what its engine can do."""

    kind: ClassVar[str]
    # PRIMARY KEY / UNIQUE / ON CONFLICT / sequences / RETURNING on inserts: the embedded file has
    # them; a lake has none, and the store keeps its invariants by other means there
    keys: ClassVar[bool] = True
    # every commit is a snapshot that can be read later (--at)
    snapshots: ClassVar[bool] = False
    # several processes (on several hosts) may write at once
    shared_writers: bool = False
    # its ``sandbox()`` confines user SQL to this database (the escape table holds); ``sql``
    # refuses a backend that does not say so
    confines_sql: ClassVar[bool] = False
    # other processes open the same database by its URL and see what this one committed (False:
    # the database lives in one process, as an in-memory one does)
    between_processes: ClassVar[bool] = True
    origin: ClassVar[str] = "headatlas"  # headatlas, or the plugin that added it

    url: str

    @property
    @abstractmethod
    def label(self) -> str:
        """How the database is named in messages, logs and status: never holds a password."""

    def __str__(self) -> str:
        return self.label

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.label!r})"

    @abstractmethod
    def check(self, *, write: bool, create: bool = True) -> None:
        """Raise DatabaseFileError when the database cannot be used (``write``: for writing;
        ``create``: a missing one may be created). Opens nothing that could change it."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether there is a database here (a file; a lake catalogue that holds tables)."""

    def prepare(self) -> None:  # noqa: B027 - a default that does nothing
        """Make the place for a new database (a file's folder); raise DatabaseFileError if impossible."""

    @abstractmethod
    def connect(self, *, read_only: bool = False, config: dict[str, Any] | None = None) -> duckdb.DuckDBPyConnection:
        """A new DuckDB connection on this database (storage-internal: nothing above the storage
        package holds one). ``config``: DuckDB settings for the connection (limits)."""

    def held(self) -> AbstractContextManager[None]:
        """Within it, this process's back-to-back transactions on the database share what opening
        it costs (a file: DuckDB's instance stays open). Default: nothing is held."""
        return nullcontext()

    @abstractmethod
    def transaction(
        self,
        *,
        read_only: bool = False,
        lock_wait_s: float | None = None,
        create: bool = True,
        at: int | None = None,
    ) -> AbstractContextManager[Connection]:
        """A SQLAlchemy connection inside one transaction: committed on success, rolled back on
        error, closed on exit. ``at``: read the database as of that snapshot (backends with
        ``snapshots`` only)."""

    @abstractmethod
    def session(self, *, lock_wait_s: float | None = None) -> AbstractContextManager[Connection]:
        """A connection outside any transaction (migrations run their own)."""

    @abstractmethod
    def sandbox(
        self, *, limits: dict[str, str] | None = None, lock_wait_s: float = 10.0, at: int | None = None
    ) -> AbstractContextManager[duckdb.DuckDBPyConnection]:
        """A read-only connection for user SQL, confined to this database (no other files, no
        settings that can be changed back) where ``confines_sql`` says so. It is opened in the
        query's own process (``confined.run_confined``), which may get this backend pickled from
        its caller: such a backend keeps plain attributes and opens its connections here."""

    # table functions a SELECT may call in this backend's sandbox beyond the common ones
    # (``sql_check.TABLE_FUNCTIONS``), and prefixes of database or schema names that are not results
    sandbox_table_functions: ClassVar[frozenset[str]] = frozenset()
    sandbox_hidden_catalogs: ClassVar[tuple[str, ...]] = ()

    def refuse_in_sandbox(self, sql: str, *, keyword: str = "SELECT") -> str | None:
        """Why a SELECT may not run in the sandbox although it parses as one (a function that
        would reach past the database, a table of its catalogue), or None."""
        from headatlas.service.storage.sql_check import refusal

        return refusal(
            sql,
            table_functions=self.sandbox_table_functions,
            hidden_catalogs=self.sandbox_hidden_catalogs,
            keyword=keyword,
        )

    def local_folder(self) -> Path:
        """A folder on this machine beside the database (a spool's default home)."""
        return Path.cwd()

    def identity(self) -> Any:
        """What tells this database's storage apart from another put in its place (a file's
        device and inode), or None when nothing can be swapped under a running process."""
        return None

    def translate(self, exc: BaseException) -> Exception | None:
        """The backend's one translation of a driver's error into headatlas's error types, or None
        when ``exc`` is not about the database: ``DatabaseLocked`` (another process holds it),
        ``StoreConflict`` (a commit refused for a concurrent change: try the work again),
        ``StoreUnavailable`` (unreachable for now), ``DatabaseFileError`` (unusable). Code that
        must react to a busy database catches those types, never a message."""
        return None

    def attach_sql(self, alias: str, *, read_only: bool) -> list[str]:
        """Statements that attach this database as ``alias`` to another connection (which
        ``prepare_connection`` was run on), for copying between databases."""
        raise NotImplementedError

    def prepare_connection(self, connection: duckdb.DuckDBPyConnection) -> None:  # noqa: B027
        """Load what ``attach_sql`` needs on a connection of another backend."""

    def maintain(self, **options: Any) -> dict[str, Any]:
        """Compact the storage (merge small files, expire old snapshots); returns what was done."""
        raise NotImplementedError

    def snapshot_of(self, conn: Connection) -> int | None:
        """The snapshot a read transaction sees (None without snapshots)."""
        return None

    def describe(self) -> dict[str, Any]:
        """Facts for status output: kind and where (no secrets)."""
        return {"backend": self.kind, "database": self.label}


def closing(connection: duckdb.DuckDBPyConnection) -> Iterator[duckdb.DuckDBPyConnection]:
    try:
        yield connection
    finally:
        connection.close()
