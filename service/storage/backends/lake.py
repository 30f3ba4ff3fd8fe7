"""The lake backend: DuckLake, its catalogue in PostgreSQL (or in a local file), its table data
as Parquet files in a folder that every host mounts.

``--db ducklake:postgres:dbname=atlas host=db.lab user=atlas`` with ``--data-path /mnt/atlas/``
(or ``HEADATLAS_DATA_PATH``): many processes on many hosts read and write at once, each commit
is a snapshot, and readers never block writers. ``--db ducklake:atlas.ducklake``: the catalogue
in a local DuckDB file, for one host (one process at a time holds it, as with an embedded file).

The extensions are loaded from the PyPI wheels ``duckdb-ext-ducklake`` and
``duckdb-ext-postgres`` (built for DuckDB 1.4.4): nothing is downloaded at run time. Loading
them and attaching the catalogue takes about a second, so a process attaches a PostgreSQL lake
once and gives each unit of work its own connection (a cursor) to that instance.

A catalogue password never reaches a message: it is taken out of the connection string into a
DuckDB secret, and ``label`` shows the URL with ``password=***``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import duckdb
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import NullPool

from headatlas.service.config import SQL_TIMEOUT_MAX_S
from headatlas.service.errors import DatabaseFileError, Param, StoreConflict, StoreError, StoreUnavailable
from headatlas.service.storage import duckdb_errors
from headatlas.service.storage.backends import lake_errors
from headatlas.service.storage.backends.base import NO_DOWNLOADS, Backend, duckdb_config, extension_directory

# the lake's faults (lake_errors.py), named here too, where the writer and the tests find them
from headatlas.service.storage.backends.lake_errors import (  # noqa: F401
    CATALOGUE,
    CATALOGUE_LOST,
    DATA_PATH,
    DATA_PATH_ERRNOS,
    DATA_PATH_FULL,
    lake_fault,
)
from headatlas.service.storage.duckdb_settings import READONLY_CONFIG
from headatlas.service.storage.locks import retry_on_lock

PREFIX = "ducklake:"
ALIAS = "lake"
METADATA = f"__ducklake_metadata_{ALIAS}"
_PACKAGES = "duckdb-ext-ducklake==1.4.4.20260205 duckdb-ext-postgres==1.4.4.20260205"
# table functions a SELECT may call in the sandbox although their names say ducklake: the results'
# history (snapshots: ids, times, the tables each changed; a table's rows changed between two), whose
# columns carry no path. Not ducklake_list_files (every data file's absolute path, its encryption
# key), ducklake_options (the data path) nor ducklake_table_info (the storage's files, their sizes):
# how the lake is stored is not a result, and a file, which has none of them, refuses them alike
SANDBOX_READS = frozenset(
    {
        "ducklake_snapshots",
        "ducklake_current_snapshot",
        "ducklake_last_committed_snapshot",
        "ducklake_table_changes",
        "ducklake_table_insertions",
        "ducklake_table_deletions",
    }
)

# a file no snapshot needs any more is deleted this long after (by a later compaction): longer than
# any writer's transaction (a group of batches, seconds) or reader's query that may still read it
# from a snapshot it began at: `sql` runs at most SQL_TIMEOUT_MAX_S (a day), after a start of at most
# its lock wait and readonly.SETUP_S; an hour more covers those
FILES_GRACE_S = SQL_TIMEOUT_MAX_S + 3600.0
COMPACTION = "compaction"  # database_info key: the compaction in progress (host, pid, since)
COMPACTION_STALE_S = 24 * 3600.0  # another host's claim older than this is left behind
# an uncatalogued data file younger than this may still be committed by a transaction in flight
# (another writer's, `db compact`'s merge): `db compact` removes only older ones
ORPHAN_AGE_S = 3600.0
PROBE_BYTES = 256 * 1024  # what the data path must take before a paused writer tries its work again

# libpq's bounds on the catalogue's connection, unless the connection string sets its own: a
# server that accepts and never completes the startup handshake (a hung server, a proxy that
# stalls) fails the attach after connect_timeout with libpq's "timeout expired", which
# lake_errors.lake_fault knows (the writer pauses and tries again), instead of waiting for ever.
# On an established session, keepalives end one whose peer is gone (a host down, a dropped
# network: no ACK to the probes after about idle + interval × count = 60 s) and tcp_user_timeout
# one whose sent data stays unacknowledged for 30 s (libpq ≥ 12). None bounds a peer that
# acknowledges and never answers: DuckDB's PostgreSQL extension waits in a blocking PQexec, with
# no query timeout of its own and deaf to DuckDB's interrupt (statement_timeout in options bounds
# only the server's own work, which never starts then).
CATALOGUE_BOUNDS: dict[str, str] = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}

_ROOTS: dict[tuple, tuple[int, duckdb.DuckDBPyConnection, Engine]] = {}
_ROOTS_LOCK = threading.Lock()


def parse_conninfo(text_: str) -> dict[str, str]:
    """A libpq connection string (``key=value …``, values optionally single-quoted) or URI
    (``postgresql://user:password@host:port/dbname?key=value``) as a dict."""
    if text_.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(text_)
        out: dict[str, str] = {}
        if parts.hostname:
            out["host"] = parts.hostname
        if parts.port:
            out["port"] = str(parts.port)
        if parts.username:
            out["user"] = unquote(parts.username)
        if parts.password:
            out["password"] = unquote(parts.password)
        if parts.path.strip("/"):
            out["dbname"] = unquote(parts.path.strip("/"))
        for pair in filter(None, parts.query.split("&")):
            key, _, value = pair.partition("=")
            out[unquote(key)] = unquote(value)
        return out
    out = {}
    pos, n = 0, len(text_)
    while pos < n:
        while pos < n and text_[pos].isspace():
            pos += 1
        if pos >= n:
            break
        match = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*").match(text_, pos)
        if match is None:
            raise ValueError(f"expected key=value at {text_[pos : pos + 20]!r}")
        key, pos = match.group(1), match.end()
        if pos < n and text_[pos] == "'":
            pos += 1
            chars: list[str] = []
            while pos < n and text_[pos] != "'":
                if text_[pos] == "\\" and pos + 1 < n:
                    pos += 1
                chars.append(text_[pos])
                pos += 1
            if pos >= n:
                raise ValueError(f"unterminated quote in the value of {key}")
            pos += 1
            out[key] = "".join(chars)
        else:
            start = pos
            while pos < n and not text_[pos].isspace():
                pos += 1
            out[key] = text_[start:pos]
    return out


def format_conninfo(values: dict[str, str]) -> str:
    def quote(value: str) -> str:
        if value and not re.search(r"[\s'\\]", value):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"

    return " ".join(f"{k}={quote(v)}" for k, v in values.items())


def bounded_conninfo(conninfo: str) -> str:
    """``conninfo`` with ``CATALOGUE_BOUNDS`` added where it sets none of its own."""
    values = parse_conninfo(conninfo)
    return format_conninfo({**values, **{k: v for k, v in CATALOGUE_BOUNDS.items() if k not in values}})


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def is_lake_url(url: str) -> bool:
    return str(url).startswith(PREFIX)


class LakeBackend(Backend):
    kind = "lake"
    keys = False
    snapshots = True
    confines_sql = True  # read-only attach, external access off, its catalogue hidden (sandbox)
    sandbox_table_functions = SANDBOX_READS
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
        self.data_path = _folder(given) if given else None

    # --- naming -----------------------------------------------------------------------------
    @property
    def label(self) -> str:
        if self.catalog == "postgres":
            shown = self.conninfo + (" password=***" if self.password else "")
            return f"{PREFIX}postgres:{shown}"
        return f"{PREFIX}{self.file}"

    def _redacted(self, message: str) -> str:
        """``message`` with any password in it replaced by ***."""
        message = re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", message)
        message = re.sub(r"(postgres(?:ql)?://[^:/@\s]*:)[^@\s]*@", r"\1***@", message)
        if getattr(self, "password", None):
            message = message.replace(self.password, "***")  # type: ignore[arg-type]
        return message

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
                dbfile.check_file(self.file, write=write, create=create)

    def exists(self) -> bool:
        """Whether the catalogue holds tables (a new PostgreSQL database is attached, and so made
        a lake, but holds none)."""
        if self.file is not None:
            return self.file.is_file()
        try:
            with self.transaction(read_only=True) as conn:
                return bool(
                    conn.execute(
                        text("SELECT count(*) FROM information_schema.tables WHERE table_catalog = :c"), {"c": ALIAS}
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
                f"CREATE OR REPLACE TEMPORARY SECRET (TYPE postgres, PASSWORD {_literal(self.password)})"
            )

    def attach_sql(
        self, alias: str, *, read_only: bool, at: int | None = None, metadata: str | None = None
    ) -> list[str]:
        """``metadata``: a catalogue other than the lake's own (the sandbox's copy of it)."""
        options = []
        if self.data_path:
            # this host's mount of the lake's files (it may differ from the host that created it)
            options.append(f"DATA_PATH {_literal(self.data_path)}, OVERRIDE_DATA_PATH true")
        if read_only:
            options.append("READ_ONLY")
        if at is not None:
            options.append(f"SNAPSHOT_VERSION {int(at)}")
        tail = f" ({', '.join(options)})" if options else ""
        return [f"ATTACH {_literal(PREFIX + (metadata or self.metadata))} AS {alias}{tail}"]

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
        """The catalogue's tables (``ducklake_*``) into a new DuckDB file ``target``, as of one
        moment: one repeatable-read PostgreSQL transaction, read-only on the server too
        (``default_transaction_read_only``). The sandbox attaches the copy, so that the instance
        that runs a reader's SQL never loads the PostgreSQL extension nor holds a session."""
        values = parse_conninfo(bounded_conninfo(self.conninfo))
        values["options"] = (values.get("options", "") + " -c default_transaction_read_only=on").strip()
        source = duckdb.connect(config=duckdb_config(threads=1))
        try:
            source.execute("LOAD postgres_scanner")
            if self.password:
                source.execute(f"CREATE TEMPORARY SECRET (TYPE postgres, PASSWORD {_literal(self.password)})")
            source.execute(f"ATTACH {_literal(format_conninfo(values))} AS catalogue (TYPE postgres, READ_ONLY)")
            source.execute(f"ATTACH {_literal(str(target))} AS copy")
            source.execute("BEGIN")
            names = [
                name
                for (name,) in source.execute(
                    "SELECT table_name FROM duckdb_tables() WHERE database_name = 'catalogue' "
                    "AND schema_name = 'public' AND starts_with(table_name, 'ducklake_') ORDER BY 1"
                ).fetchall()
            ]
            for name in names:
                quoted = '"' + name.replace('"', '""') + '"'
                source.execute(f"CREATE TABLE copy.main.{quoted} AS SELECT * FROM catalogue.public.{quoted}")
            source.execute("COMMIT")
        except duckdb.Error as exc:
            raise self._attach_error(exc, None) from None
        finally:
            source.close()

    def _attach_error(self, exc: duckdb.Error, at: int | None) -> Exception:
        """Attaching failed: the translation (a file catalogue held by another process is
        ``DatabaseLocked``, which ``retry_on_lock`` waits out), else the driver's first line."""
        translated = lake_errors.translate(exc, self.label, at=at)
        if isinstance(translated, StoreUnavailable):
            return self._redacted_fault(translated)
        if translated is not None:
            return translated
        first = self._redacted(duckdb_errors.first_line(exc))
        return DatabaseFileError(f"cannot open the lake {self.label} ({first[:300]})")

    def _root(self) -> tuple[duckdb.DuckDBPyConnection, Engine]:
        """This process's instance of the lake (a PostgreSQL catalogue), attached once."""
        key = (self.metadata, self.password, self.data_path)
        with _ROOTS_LOCK:
            held = _ROOTS.get(key)
            if held is not None and held[0] == os.getpid():
                return held[1], held[2]
            root = self.connect()
            engine = self._engine(root)
            _ROOTS[key] = (os.getpid(), root, engine)
            return root, engine

    def _forget_root(self) -> None:
        key = (self.metadata, self.password, self.data_path)
        with _ROOTS_LOCK:
            held = _ROOTS.pop(key, None)
        if held is not None and held[0] == os.getpid():
            try:
                held[1].close()
            except duckdb.Error:
                pass

    @staticmethod
    def _engine(root: duckdb.DuckDBPyConnection) -> Engine:
        from duckdb_engine import ConnectionWrapper

        def cursor():
            connection = root.cursor()
            connection.execute(f"USE {ALIAS}")
            return ConnectionWrapper(connection)

        return create_engine("duckdb://", creator=cursor, poolclass=NullPool)

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
        engine = self._engine(own)
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
            return self._redacted_fault(translated)
        return translated

    def _redacted_fault(self, fault: StoreUnavailable) -> StoreUnavailable:
        if self.password and self.password in str(fault) + fault.cause:
            return StoreUnavailable(
                self._redacted(str(fault)), waits_for=fault.waits_for, cause=self._redacted(fault.cause)
            )
        return fault

    def probe(self, waits_for: str) -> None:
        """Raise StoreUnavailable while ``waits_for`` is still unavailable: the catalogue, by a
        read that reaches it; the data path (a local folder), by writing and removing a file of
        a few blocks there (a full or read-only one refuses it)."""
        with self.transaction(read_only=True) as conn:
            conn.execute(text(f"SELECT id FROM ducklake_current_snapshot('{ALIAS}')")).scalar()
        if waits_for != DATA_PATH or not self.data_path or "://" in self.data_path:
            return
        probe = Path(self.data_path) / f".headatlas-probe-{os.getpid()}"
        try:
            with open(probe, "wb") as out:
                out.write(b"\0" * PROBE_BYTES)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            raise lake_fault(exc, self.label) or StoreUnavailable(
                f"{DATA_PATH} of {self.label} takes no file now ({exc.strerror})", waits_for=DATA_PATH
            ) from None
        finally:
            try:
                probe.unlink()
            except OSError:
                pass

    def orphan_files(self) -> list[str]:
        """The lake's data files that its catalogue does not know (a write that failed after
        its file was created), by DuckLake's own listing; only its ``ducklake-*.parquet``."""
        with self.session() as conn:
            rows = conn.execute(
                text(
                    f"SELECT path FROM ducklake_delete_orphaned_files('{ALIAS}', dry_run => true, cleanup_all => true)"
                )
            ).all()
        return sorted(p for (p,) in rows if _is_data_file(p))

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
                lambda: self.connect(read_only=True, config=limits, at=at, metadata=metadata),
                wait_s=lock_wait_s,
                what=self.label,
            )
            try:
                data = self.data_path  # this host's mount, else the one the catalogue recorded
                if data is None:
                    row = connection.execute(
                        f"SELECT value FROM ducklake_options('{ALIAS}') WHERE option_name = 'data_path'"
                    ).fetchone()
                    data = row[0] if row else None
                if data and "://" not in data:
                    connection.execute(f"SET allowed_directories = [{_literal(data)}]")
                for name, value in READONLY_CONFIG.items():
                    if name not in NO_DOWNLOADS:
                        connection.execute(f"SET {name} = {str(value).lower()}")
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
        the current one) and delete the files no snapshot needs any more: DuckLake's own
        functions, one at a time (each is its own commit). One compaction at a time: a second is
        refused while the first runs (``_claim_compaction``). A file is deleted only once no
        snapshot has needed it for ``files_grace_s``: a writer's or reader's transaction that
        began before the expiry still reads it (the next compaction deletes it)."""
        cutoff = f"now() - INTERVAL {float(older_than_days) * 86400:.0f} SECOND"
        files_cutoff = f"now() - INTERVAL {max(0.0, float(files_grace_s)):.0f} SECOND"
        token = self._claim_compaction()
        try:
            root = self.connect()
            try:
                before = _lake_counts(root)
                started = time.monotonic()
                self._maintenance(root, f"CALL ducklake_merge_adjacent_files('{ALIAS}')")
                self._maintenance(root, f"CALL ducklake_expire_snapshots('{ALIAS}', older_than => {cutoff})")
                self._maintenance(root, f"CALL ducklake_cleanup_old_files('{ALIAS}', older_than => {files_cutoff})")
                orphans = _remove_orphans(root, ORPHAN_AGE_S)
                after = _lake_counts(root)
                return {
                    "files_before": before[0],
                    "files_after": after[0],
                    "snapshots_before": before[1],
                    "snapshots_after": after[1],
                    "orphans_removed": orphans,
                    "seconds": round(time.monotonic() - started, 2),
                }
            finally:
                root.close()
        finally:
            self._release_compaction(token)

    def _maintenance(self, root: duckdb.DuckDBPyConnection, call: str, tries: int = 20) -> None:
        """One maintenance call, tried again when a writer's commit changed the same files."""
        delay = 0.05
        for attempt in range(tries):
            try:
                root.execute(call)
                return
            except duckdb.Error as exc:
                translated = self.translate(exc)
                if not isinstance(translated, StoreConflict):
                    raise translated or DatabaseFileError(
                        f"db compact of {self.label}: {self._redacted(str(exc)).strip().splitlines()[0][:300]}"
                    ) from None
                if attempt == tries - 1:
                    raise StoreConflict(
                        f"db compact of {self.label}: writers kept changing the files it merges; run it again"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def _claim_compaction(self) -> str:
        """Hold the lake's compaction (a row in database_info, claimed under ``db.serialize``:
        two claims at once conflict, and the second, tried again, finds the first). A second
        `db compact` while one runs is refused in one line; a claim whose process is gone (this
        host) or older than COMPACTION_STALE_S (another host) is taken over."""
        import socket
        import uuid

        from headatlas.service.errors import StoreBusy
        from headatlas.service.storage import db

        token = uuid.uuid4().hex
        mine = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}

        def claim(conn: Connection) -> None:
            db.serialize(conn)
            raw = conn.execute(text("SELECT value FROM database_info WHERE key = :k"), {"k": COMPACTION}).scalar()
            held = json.loads(raw) if raw else None
            if held is not None and not _claim_gone(held):
                started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"]))
                raise StoreBusy(
                    f"another `db compact` of {self.label} is running ({held['host']}:{held['pid']}, since {started}): "
                    "wait for it to end, then run it again if needed"
                )
            conn.execute(text("DELETE FROM database_info WHERE key = :k"), {"k": COMPACTION})
            conn.execute(text("INSERT INTO database_info VALUES (:k, :v)"), {"k": COMPACTION, "v": json.dumps(mine)})

        db.atomically(self, claim)
        return token

    def _release_compaction(self, token: str) -> None:
        from headatlas.service.storage import db

        def release(conn: Connection) -> None:
            raw = conn.execute(text("SELECT value FROM database_info WHERE key = :k"), {"k": COMPACTION}).scalar()
            if raw and json.loads(raw).get("token") == token:
                conn.execute(text("DELETE FROM database_info WHERE key = :k"), {"k": COMPACTION})

        db.atomically(self, release)


def _claim_gone(held: dict) -> bool:
    """Whether a compaction claim is left behind: its process is gone (this host), or it is older
    than COMPACTION_STALE_S (another host's, which cannot be asked)."""
    import socket

    if held.get("host") == socket.gethostname():
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return time.time() - float(held.get("since", 0)) > COMPACTION_STALE_S


def _is_data_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("ducklake-") and name.endswith(".parquet")


def _remove_orphans(connection: duckdb.DuckDBPyConnection, older_than_s: float) -> int:
    """Delete the lake's data files its catalogue does not know, last changed over
    ``older_than_s`` ago (a younger one may belong to a transaction still in flight elsewhere);
    only DuckLake's own files (``ducklake-*.parquet``). How many."""
    rows = connection.execute(
        f"SELECT path FROM ducklake_delete_orphaned_files('{ALIAS}', dry_run => true, "
        f"older_than => now() - INTERVAL {max(0.0, float(older_than_s)):.0f} SECOND)"
    ).fetchall()
    removed = 0
    for (path,) in rows:
        if _is_data_file(path) and "://" not in path:
            try:
                os.remove(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _lake_counts(connection: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """(live Parquet data files, snapshots) of the lake."""
    files = connection.execute(
        f"SELECT count(*) FROM {METADATA}.ducklake_data_file WHERE end_snapshot IS NULL"
    ).fetchone()
    snaps = connection.execute(f"SELECT count(*) FROM ducklake_snapshots('{ALIAS}')").fetchone()
    return int(files[0]) if files else 0, int(snaps[0]) if snaps else 0


def _folder(path: str) -> str:
    """A data path as DuckLake wants it: absolute for a local folder, ending in a slash."""
    if "://" not in path:
        path = str(Path(path).expanduser().absolute())
    return path if path.endswith("/") else path + "/"


_SKIP_DDL = re.compile(r"^\s*(CREATE|DROP)\s+SEQUENCE\b", re.IGNORECASE)
_LAKE_DDL = [
    (re.compile(r"\s+DEFAULT\s+nextval\s*\(\s*'[^']*'\s*\)", re.IGNORECASE), ""),
    (re.compile(r"\s+DEFAULT\s+current_timestamp\b", re.IGNORECASE), ""),
    (re.compile(r",\s*PRIMARY\s+KEY\s*\([^)]*\)", re.IGNORECASE), ""),
    (re.compile(r"\s+PRIMARY\s+KEY\b", re.IGNORECASE), ""),
    (re.compile(r"\s+UNIQUE\b(?!\s*\()", re.IGNORECASE), ""),
]


def lake_ddl(statement: str) -> str | None:
    """A migration's statement as a lake takes it, or None to skip it: DuckLake has no
    sequences, PRIMARY KEY or UNIQUE, and only literal defaults. The store keeps those
    invariants itself there (ids under a serialising update, ledger checks with conflict
    retry); an embedded file keeps its constraints, and its DDL is never rewritten."""
    if _SKIP_DDL.match(statement):
        return None
    for pattern, replacement in _LAKE_DDL:
        statement = pattern.sub(replacement, statement)
    return statement


def release(backend: LakeBackend) -> None:
    """Close this process's attachment of ``backend``'s lake (its next use attaches again)."""
    backend._forget_root()
