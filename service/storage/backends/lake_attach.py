"""This process's attachment of a lake whose catalogue is in PostgreSQL, shared by its units of
work.

Loading DuckDB's extensions and attaching the catalogue takes about a second, so a process attaches
such a lake once (its root instance, kept per process: a forked child attaches its own) and gives
each unit of work its own connection to it, a cursor, through a SQLAlchemy engine. A lost catalogue
leaves the root's connections to PostgreSQL dead: ``forget_root`` closes it, and the next unit of
work attaches afresh.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable

import duckdb
from sqlalchemy import create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from headatlas.service.storage.backends.lake_catalogue import ALIAS

_ROOTS: dict[Hashable, tuple[int, duckdb.DuckDBPyConnection, Engine]] = {}
_ROOTS_LOCK = threading.Lock()


def shared_root(
    key: Hashable, connect: Callable[[], duckdb.DuckDBPyConnection]
) -> tuple[duckdb.DuckDBPyConnection, Engine]:
    """This process's instance of the lake ``key`` names, attached once (by ``connect``), and
    the engine on its cursors."""
    with _ROOTS_LOCK:
        held = _ROOTS.get(key)
        if held is not None and held[0] == os.getpid():
            return held[1], held[2]
        root = connect()
        engine = cursor_engine(root)
        _ROOTS[key] = (os.getpid(), root, engine)
        return root, engine


def forget_root(key: Hashable) -> None:
    """Close this process's instance of the lake ``key`` names (its next use attaches again)."""
    with _ROOTS_LOCK:
        held = _ROOTS.pop(key, None)
    if held is not None and held[0] == os.getpid():
        try:
            held[1].close()
        except duckdb.Error:
            pass


def cursor_engine(root: duckdb.DuckDBPyConnection) -> Engine:
    """A SQLAlchemy engine whose every connection is a new cursor of ``root``, on the lake."""
    from duckdb_engine import ConnectionWrapper

    def cursor():
        connection = root.cursor()
        connection.execute(f"USE {ALIAS}")
        return ConnectionWrapper(connection)

    return create_engine("duckdb://", creator=cursor, poolclass=NullPool)
