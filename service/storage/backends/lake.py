"""The lake backend: DuckLake, its catalogue in PostgreSQL (or in a local file), its table data
as Parquet files in a folder that every host mounts.

``--db ducklake:postgres:dbname=atlas host=db.lab user=atlas`` with ``--data-path /mnt/atlas/``
(or ``HEADATLAS_DATA_PATH``): many processes on many hosts read and write at once, each commit
is a snapshot, and readers never block writers. ``--db ducklake:atlas.ducklake``: the catalogue
in a local DuckDB file, for one host (one process at a time holds it, as with an embedded file).

The extensions are loaded from the PyPI wheels ``duckdb-ext-ducklake`` and
``duckdb-ext-postgres`` (built for DuckDB 1.4.4): nothing is downloaded at run time. Loading
them and attaching the catalogue takes about a second, so a process attaches a PostgreSQL lake
once and gives each unit of work its own connection (a cursor) to that instance (``lake_attach``).

A catalogue password never reaches a message: it is taken out of the connection string into a
DuckDB secret, and ``label`` shows the URL with ``password=***`` (``lake_catalogue``).

This module is the backend itself: the URL it is given, opening and attaching the lake (as of a
snapshot, ``--at``), its transactions and the translation of their errors. Beside it:
``lake_catalogue`` (the URL, the connection string, redaction), ``lake_attach`` (the process's
attachment), ``lake_errors`` (its faults), ``lake_sandbox`` (user SQL), ``lake_compaction``
(``db compact``) and ``lake_ddl`` (migrations on a lake).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from headatlas.service.errors import DatabaseFileError, Param, StoreError, StoreUnavailable
from headatlas.service.storage import duckdb_errors
from headatlas.service.storage.backends import lake_attach, lake_compaction, lake_errors, lake_sandbox
from headatlas.service.storage.backends.base import Backend, duckdb_config, extension_directory
from headatlas.service.storage.backends.lake_catalogue import (
    ALIAS,
    PREFIX,
    bounded_conninfo,
    data_folder,
    format_conninfo,
    parse_conninfo,
    redact,
    redact_fault,
    sql_literal,
)
from headatlas.service.storage.backends.lake_compaction import FILES_GRACE_S
from headatlas.service.storage.backends.lake_errors import CATALOGUE, DATA_PATH
from headatlas.service.storage.duckdb_settings import SIGNED_EXTENSIONS
from headatlas.service.storage.locks import retry_on_lock

_PACKAGES = "duckdb-ext-ducklake==1.4.4.20260205 duckdb-ext-postgres==1.4.4.20260205"


class LakeBackend(Backend):
    kind = "lake"
    keys = False
    snapshots = True
    confines_sql = True  # read-only attach, external access off, its catalogue hidden (sandbox)
    sandbox_table_functions = lake_sandbox.SANDBOX_READS
    sandbox_hidden_catalogs = ("__ducklake_metadata",)

    def __init__(self, url: str, *, data_path: str | Path | None = None):
        self.url = str(url)
        spec = self.url[len(PREFIX) :]
        self.password: str | None = None
        if spec.startswith("postgres:"):
            self.catalog = "postgres"
            try:
                values = parse_conninfo(spec[len("postgres:") :])
            except ValueError as exc:
                raise StoreError(
                    Param("db", self._redacted(self.url)), f": not a PostgreSQL connection string ({exc})"
                ) from None
            self.password = values.pop("password", None) or None
            self.conninfo = format_conninfo(values)  # as given: the label shows it
            self.metadata = f"postgres:{bounded_conninfo(self.conninfo)}"
            self.file: Path | None = None
        elif spec and not spec.startswith(("sqlite:", "mysql:")):
            self.catalog = "duckdb"
            self.file = Path(spec).absolute()
            self.conninfo = ""
            self.metadata = str(self.file)
        else:
            raise StoreError(
                Param("db", self._redacted(self.url)),
                ": use ducklake:postgres:dbname=NAME host=HOST … (a catalogue in PostgreSQL) or ducklake:FILE.ducklake "
                "(a catalogue in a local file)",
            )
        # a PostgreSQL catalogue takes many writers; a file catalogue is held by one process at a time
        self.shared_writers = self.catalog == "postgres"
        from headatlas.service.config import check_setting

        given = str(data_path) if data_path else check_setting("data_path", os.environ.get("HEADATLAS_DATA_PATH", ""))
        self.data_path = data_folder(given) if given else None

    # --- naming -----------------------------------------------------------------------------
    @property
    def label(self) -> str:
        if self.catalog == "postgres":
            shown = self.conninfo + (" password=***" if self.password else "")
            return f"{PREFIX}postgres:{shown}"
        return f"{PREFIX}{self.file}"

    def _redacted(self, message: str) -> str:
        """``message`` with any password in it replaced by ***."""
        return redact(message, getattr(self, "password", None))

    def describe(self) -> dict[str, Any]:
        return {
            "backend": self.kind,
            "database": self.label,
            "data_path": self.data_path or "(stored in the catalogue)",
        }

    def local_folder(self) -> Path:
        if self.data_path and "://" not in self.data_path:
            return Path(self.data_path)
        return self.file.parent if self.file is not None else Path.cwd()

    # --- checks -----------------------------------------------------------------------------
    def check(self, *, write: bool, create: bool = True) -> None:
        if extension_directory() is None:
            raise DatabaseFileError(
                Param("db", self.label), f" needs DuckDB's DuckLake and PostgreSQL extensions: pip install {_PACKAGES}"
            )
        if self.file is not None:
            from headatlas.service.storage import dbfile

            if self.file.exists() or not (write and create):
                dbfile.check_file(self.file, write=write, create=create, serialised=False)

    def exists(self) -> bool:
        """Whether the catalogue holds tables (a new PostgreSQL database is attached, and so made
        a lake, but holds none)."""
        if self.file is not None:
            return self.file.is_file()
        try:
            with self.transaction(read_only=True) as conn:
                # duckdb_tables(), not information_schema.tables (a view over it and the views'
                # catalogue): 33 ms a call, asked before every lake command's first transaction
                return bool(
                    conn.execute(
                        text("SELECT count(*) FROM duckdb_tables() WHERE database_name = :c"), {"c": ALIAS}
                    ).scalar()
                )
        except StoreError:
            return False

    def prepare(self) -> None:
        if self.file is not None:
            try:
                self.file.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseFileError(f"cannot create the folder of {self.file} ({exc.strerror})") from None
        if self.data_path and "://" not in self.data_path:
            try:
                Path(self.data_path).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise DatabaseFileError(
                    Param("data_path", self.data_path),
                    f": cannot create the folder ({exc.strerror})",
                    hint="pass a writable folder",
                ) from None

    # --- connections ------------------------------------------------------------------------
    def prepare_connection(self, connection: duckdb.DuckDBPyConnection) -> None:
        connection.execute("LOAD ducklake")
        if self.catalog == "postgres":
            connection.execute("LOAD postgres_scanner")
        if self.password:
            connection.execute(
                f"CREATE OR REPLACE TEMPORARY SECRET (TYPE postgres, PASSWORD {sql_literal(self.password)})"
            )

    def attach_sql(
        self, alias: str, *, read_only: bool, at: int | None = None, metadata: str | None = None
    ) -> list[str]:
        """``metadata``: a catalogue other than the lake's own (the sandbox's copy of it)."""
        options = []
        if self.data_path:
            # this host's mount of the lake's files (it may differ from the host that created it)
            options.append(f"DATA_PATH {sql_literal(self.data_path)}, OVERRIDE_DATA_PATH true")
        if read_only:
            options.append("READ_ONLY")
        if at is not None:
            options.append(f"SNAPSHOT_VERSION {int(at)}")
        tail = f" ({', '.join(options)})" if options else ""
        return [f"ATTACH {sql_literal(PREFIX + (metadata or self.metadata))} AS {alias}{tail}"]

    def connect(
        self,
        *,
        read_only: bool = False,
        config: dict[str, Any] | None = None,
        at: int | None = None,
        metadata: str | None = None,
    ) -> duckdb.DuckDBPyConnection:
        """A new DuckDB instance with the lake attached as ``lake`` (and made the default);
        ``metadata``: a copy of its catalogue in a DuckDB file instead of the catalogue itself
        (only DuckLake is loaded then, not the PostgreSQL extension)."""
        self.check(write=not read_only)
        connection = duckdb.connect(config=duckdb_config(**(config or {})))
        try:
            if metadata is None:
                self.prepare_connection(connection)
            else:
                connection.execute("LOAD ducklake")
            for statement in self.attach_sql(ALIAS, read_only=read_only, at=at, metadata=metadata):
                connection.execute(statement)
            connection.execute(f"USE {ALIAS}")
            connection.execute("SET ducklake_max_retry_count = 100")
        except duckdb.Error as exc:
            connection.close()
            raise self._attach_error(exc, at) from None
        return connection

    def copy_catalogue(self, target: Path) -> None:
        """The catalogue's tables into a new DuckDB file ``target``, as of one moment
        (``lake_sandbox.copy_catalogue``): the sandbox attaches the copy."""
        lake_sandbox.copy_catalogue(
            self.conninfo, self.password, target, failed=lambda exc: self._attach_error(exc, None)
        )

    def _attach_error(self, exc: duckdb.Error, at: int | None) -> Exception:
        """Attaching failed: the translation (a file catalogue held by another process is
        ``DatabaseLocked``, which ``retry_on_lock`` waits out), else the driver's first line."""
        translated = lake_errors.translate(exc, self.label, at=at)
        if isinstance(translated, StoreUnavailable):
            return redact_fault(translated, self.password)
        if translated is not None:
            return translated
        first = self._redacted(duckdb_errors.first_line(exc))
        return DatabaseFileError(f"cannot open the lake {self.label} ({first[:300]})")

    def _root(self) -> tuple[duckdb.DuckDBPyConnection, Engine]:
        """This process's instance of the lake (a PostgreSQL catalogue), attached once."""
        return lake_attach.shared_root((self.metadata, self.password, self.data_path), self.connect)

    def _forget_root(self) -> None:
        lake_attach.forget_root((self.metadata, self.password, self.data_path))

    @contextmanager
    def _engine_for(self, *, read_only: bool, at: int | None, lock_wait_s: float | None) -> Iterator[Engine]:
        if at is None and self.catalog == "postgres":
            yield self._root()[1]
            return
        # a snapshot, or a file catalogue (one process at a time): an instance of its own,
        # closed at the end
        wait = 30.0 if lock_wait_s is None else lock_wait_s
        own = retry_on_lock(
            lambda: self.connect(read_only=read_only or at is not None, at=at), wait_s=wait, what=self.label
        )
        engine = lake_attach.cursor_engine(own)
        try:
            yield engine
        finally:
            engine.dispose()
            own.close()

    @contextmanager
    def transaction(
        self,
        *,
        read_only: bool = False,
        lock_wait_s: float | None = None,
        create: bool = True,
        at: int | None = None,
    ) -> Iterator[Connection]:
        # the cursor's ``USE lake`` (in engine.connect) is the first to meet a lost catalogue
        try:
            with self._engine_for(read_only=read_only, at=at, lock_wait_s=lock_wait_s) as engine:
                with engine.connect() as conn, conn.begin():
                    yield conn
        except Exception as exc:
            raise self.translate(exc) or exc  # noqa: B904 - the error or its translation

    @contextmanager
    def session(self, *, lock_wait_s: float | None = None) -> Iterator[Connection]:
        try:
            with self._engine_for(read_only=False, at=None, lock_wait_s=lock_wait_s) as engine:
                with engine.connect() as conn:
                    yield conn
        except Exception as exc:
            raise self.translate(exc) or exc  # noqa: B904 - the error or its translation

    def translate(self, exc: BaseException) -> Exception | None:
        """``lake_errors.translate``; a lost catalogue also drops this process's attachment (its
        connections to PostgreSQL are dead: the next unit of work attaches afresh)."""
        translated = lake_errors.translate(exc, self.label)
        if isinstance(translated, StoreUnavailable):
            if translated.waits_for == CATALOGUE:
                self._forget_root()
            return redact_fault(translated, self.password)
        return translated

    def probe(self, waits_for: str) -> None:
        """Raise StoreUnavailable while ``waits_for`` is still unavailable: the catalogue, by a
        read that reaches it; the data path (a local folder), by writing and removing a file of
        a few blocks there (a full or read-only one refuses it)."""
        with self.transaction(read_only=True) as conn:
            conn.execute(text(f"SELECT id FROM ducklake_current_snapshot('{ALIAS}')")).scalar()
        if waits_for != DATA_PATH or not self.data_path or "://" in self.data_path:
            return
        lake_errors.probe_data_path(self.data_path, self.label)

    def orphan_files(self) -> list[str]:
        """The lake's data files that its catalogue does not know (``lake_compaction.orphan_files``)."""
        return lake_compaction.orphan_files(self)

    # --- user SQL ---------------------------------------------------------------------------
    @contextmanager
    def sandbox(
        self, *, limits: dict[str, str] | None = None, lock_wait_s: float = 10.0, at: int | None = None
    ) -> Iterator[duckdb.DuckDBPyConnection]:
        """The lake attached read-only in an instance that can reach nothing but it: files readable
        only under its data path, the configuration locked. A PostgreSQL catalogue is first copied
        (``copy_catalogue``) into a private folder and the copy attached: the instance never loads
        the PostgreSQL extension (its functions do not exist there, and ``LOAD`` is refused with
        external access off) and holds no session, no password, no connection string."""
        with tempfile.TemporaryDirectory(prefix="headatlas-catalogue-") as folder:
            metadata = None
            if self.catalog == "postgres":
                metadata = str(Path(folder) / "catalogue.ducklake")
                self.copy_catalogue(Path(metadata))
            connection = retry_on_lock(
                # the signature of the DuckLake extension it loads checked: the reader's SQL runs here
                lambda: self.connect(
                    read_only=True, config={**(limits or {}), **SIGNED_EXTENSIONS}, at=at, metadata=metadata
                ),
                wait_s=lock_wait_s,
                what=self.label,
            )
            try:
                lake_sandbox.confine(connection, self.data_path)  # this host's mount, else the recorded one
                yield connection
            finally:
                connection.close()

    # --- snapshots and maintenance ----------------------------------------------------------
    def snapshot_of(self, conn: Connection) -> int | None:
        return conn.execute(text(f"SELECT id FROM ducklake_current_snapshot('{ALIAS}')")).scalar()

    def maintain(
        self, *, older_than_days: float = 7.0, files_grace_s: float = FILES_GRACE_S, **_options: Any
    ) -> dict[str, Any]:
        """Merge small Parquet files, expire snapshots older than ``older_than_days`` (0: all but
        the current one) and delete the files no snapshot has needed for ``files_grace_s``, one
        compaction at a time (``lake_compaction.maintain``)."""
        return lake_compaction.maintain(
            self, older_than_days=older_than_days, files_grace_s=files_grace_s, redact=self._redacted
        )


def release(backend: LakeBackend) -> None:
    """Close this process's attachment of ``backend``'s lake (its next use attaches again)."""
    backend._forget_root()
