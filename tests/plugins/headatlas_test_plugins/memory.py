"""An in-memory DuckDB database per name and process: ``--db memduck:NAME``.

Every connection is a cursor of one in-memory DuckDB instance, so transactions see each other's
commits as a file's do, keys and sequences included; other processes never see it. Its sandbox
cannot be confined (user SQL would run on the process's own in-memory instance, with nothing
between it and the machine's files), so it says so and ``headatlas sql`` refuses it."""

import threading
from contextlib import contextmanager

import duckdb
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from headatlas.service.storage.backends.base import Backend, duckdb_config

_DATABASES: dict[str, duckdb.DuckDBPyConnection] = {}
_LOCK = threading.Lock()


class MemoryBackend(Backend):
    kind = "memduck"
    keys = True  # a DuckDB database: PRIMARY KEY, ON CONFLICT and sequences work
    confines_sql = False
    between_processes = False

    def __init__(self, url, *, data_path=None):
        self.url = url
        self.name = url.split(":", 1)[1]

    @property
    def label(self):
        return self.url

    def _root(self):
        with _LOCK:
            if self.name not in _DATABASES:
                _DATABASES[self.name] = duckdb.connect(":memory:", config=duckdb_config())
            return _DATABASES[self.name]

    def check(self, *, write, create=True):
        pass  # nothing on disk to check

    def exists(self):
        if self.name not in _DATABASES:
            return False
        return bool(self._root().cursor().execute("SELECT count(*) FROM duckdb_tables()").fetchone()[0])

    def connect(self, *, read_only=False, config=None):
        return self._root().cursor()  # a connection of its own on the shared instance

    def _engine(self):
        from duckdb_engine import ConnectionWrapper

        return create_engine("duckdb://", creator=lambda: ConnectionWrapper(self.connect()), poolclass=NullPool)

    @contextmanager
    def transaction(self, *, read_only=False, lock_wait_s=None, create=True, at=None):
        engine = self._engine()
        try:
            with engine.connect() as conn, conn.begin():
                yield conn
        finally:
            engine.dispose()

    @contextmanager
    def session(self, *, lock_wait_s=None):
        engine = self._engine()
        try:
            with engine.connect() as conn:
                yield conn
        finally:
            engine.dispose()

    @contextmanager
    def sandbox(self, *, limits=None, lock_wait_s=10.0, at=None):
        raise NotImplementedError("an in-memory database cannot confine user SQL (confines_sql is False)")
        yield  # a generator, as the contract's context manager
