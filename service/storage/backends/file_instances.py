"""DuckDB instances kept between the transactions of one process, each file ATTACHed to one while
the process uses it.

Opening a headatlas file with ``duckdb.connect`` costs about 15 ms of CPU, half of it DuckDB's
instance alone (its built-in functions and extensions, set up afresh each time), the other half the
file's catalogue; closing it is a checkpoint. A process that runs many transactions (a run's
start and end, a writer's groups, a notebook's queries, a test suite) paid the instance at each.
Here an instance, once made, outlives its file: the file is ``ATTACH``ed to it (the catalogue
read, the file's lock taken) and ``DETACH``ed when the last connection of the process on it closes
(checkpointed, the lock released, exactly as ``close`` did), and the empty instance waits for the
next file. Each instance holds one file at most, under the name DuckDB gives a file it opens (its
stem, ``current_database()``), so that what a connection sees is what a connection to the file
alone saw: one headatlas database, ``system`` and ``temp``, and the empty ``memory`` it starts in.

Not shared across ``fork``: a child forgets its parent's instances (and never closes them).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, cast

import duckdb

from headatlas.service.storage.duckdb_settings import duckdb_config

# the instance's own catalogues: a file whose stem is one of these is opened by duckdb.connect
RESERVED = frozenset({"memory", "system", "temp", "main"})
_IDLE_KEPT = 2  # empty instances kept for the next file (threads of a process rarely hold more files at once)

_LOCK = threading.RLock()
_IDLE: list[tuple[tuple, duckdb.DuckDBPyConnection]] = []  # (config, instance) with no file attached
_SETTINGS: dict[int, dict[str, str]] = {}  # id(instance) -> its settings as made (restored before reuse)
_ATTACHED: dict[str, _Attachment] = {}  # absolute path -> its attachment
_FORKED: list[Any] = []  # a forked child's inherited instances: referenced, never closed


class _Attachment:
    def __init__(self, config: tuple, instance: duckdb.DuckDBPyConnection, alias: str, read_only: bool):
        self.config, self.instance, self.alias, self.read_only = config, instance, alias, read_only
        self.users = 0


def _forget() -> None:
    _FORKED.extend(instance for _config, instance in _IDLE)
    _FORKED.extend(a.instance for a in _ATTACHED.values())
    _IDLE.clear()
    _ATTACHED.clear()
    _SETTINGS.clear()
    _LOCK._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_forget)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def alias_of(where: str) -> str | None:
    """The name DuckDB gives the file when it opens it (its stem); None where an instance's own
    catalogue has that name (the file is then opened on an instance of its own)."""
    stem = Path(where).stem if Path(where).suffix else Path(where).name
    return None if not stem or stem.lower() in RESERVED else stem


class AttachedConnection:
    """A connection on a kept instance, in the file's database; ``close`` ends this process's use
    of the file when it is the last (the file detached: checkpointed, its lock released)."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection, where: str):
        self._cursor: duckdb.DuckDBPyConnection | None = cursor
        self._where = where

    def __getattr__(self, name: str) -> Any:
        if self._cursor is None:
            raise duckdb.ConnectionException("Connection already closed!")
        return getattr(self._cursor, name)

    def cursor(self) -> duckdb.DuckDBPyConnection:
        assert self._cursor is not None
        return self._cursor.cursor()

    def close(self) -> None:
        cursor, self._cursor = self._cursor, None
        if cursor is None:
            return
        try:
            cursor.close()  # its open transaction, if any, rolled back
        finally:
            release(self._where)

    def __del__(self) -> None:  # dropped unclosed: as a DuckDB connection's own destructor closes it
        try:
            self.close()
        except Exception:  # noqa: BLE001, S110 - in the garbage collector: nowhere to report it
            pass

    def __enter__(self) -> AttachedConnection:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def _take(config: tuple) -> duckdb.DuckDBPyConnection:
    for i, (kept, instance) in enumerate(_IDLE):
        if kept == config:
            del _IDLE[i]
            return instance
    instance = duckdb.connect(":memory:", config=dict(config))
    _SETTINGS[id(instance)] = _settings(instance)
    return instance


def _settings(instance: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(instance.execute("SELECT name, value FROM duckdb_settings()").fetchall())


def _put_back(config: tuple, instance: duckdb.DuckDBPyConnection) -> None:
    """Keep the empty instance for the next file, its settings as they were made: a transaction's
    ``SET`` of a global option (storing's ``threads``) ends with its file, as it did when the file
    closed with its instance. One whose settings cannot be restored is closed."""
    made = _SETTINGS.get(id(instance), {})
    try:
        now = _settings(instance)  # about 1.5 ms: read once where nothing changed, the usual case
        if now != made:
            for name, value in now.items():
                if name in made and made[name] != value:
                    instance.execute(f"SET GLOBAL {name} = ?", [made[name]])
            if _settings(instance) != made:
                raise duckdb.Error("settings not restored")
    except duckdb.Error:
        _close(instance)
        return
    _IDLE.append((config, instance))
    while len(_IDLE) > _IDLE_KEPT:
        _close(_IDLE.pop(0)[1])


def _close(instance: duckdb.DuckDBPyConnection) -> None:
    _SETTINGS.pop(id(instance), None)
    instance.close()


def connect(where: str, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """A connection to the file at ``where`` (absolute), read-only or not: on the instance it is
    attached to in this process, or on a kept instance it is attached to now. Fails as
    ``duckdb.connect`` fails (the file locked by another process, damaged, not a DuckDB file)."""
    alias = alias_of(where)
    if alias is None:
        return duckdb.connect(where, read_only=read_only, config=duckdb_config())
    with _LOCK:
        attachment = _ATTACHED.get(where)
        if attachment is not None:
            if attachment.read_only and not read_only:
                # as duckdb.connect refuses a second connection to one file with other settings
                raise duckdb.ConnectionException(
                    f"Can't open a connection to same database file with a different configuration than existing "
                    f"connections: {where} is open read-only in this process"
                )
        else:
            config = tuple(sorted(duckdb_config().items()))
            instance = _take(config)
            try:
                attach(instance, where, alias, read_only=read_only)
            except BaseException:
                _put_back(config, instance)
                raise
            attachment = _ATTACHED[where] = _Attachment(config, instance, alias, read_only)
        cursor = attachment.instance.cursor()
        attachment.users += 1
        try:
            cursor.execute(f"USE {_quoted(attachment.alias)}")
        except BaseException:
            cursor.close()
            release(where)
            raise
        # a connection's methods, by delegation to its cursor: typed as one
        return cast(duckdb.DuckDBPyConnection, AttachedConnection(cursor, where))


def attach(instance: duckdb.DuckDBPyConnection, where: str, alias: str, *, read_only: bool) -> None:
    """The file opened: its catalogue read, its lock taken (what ``duckdb.connect`` of it did after
    making an instance)."""
    path = where.replace("'", "''")
    instance.execute(f"ATTACH '{path}' AS {_quoted(alias)}" + (" (READ_ONLY)" if read_only else ""))


def release(where: str) -> None:
    """One connection on ``where`` ended; the file is detached when it was the process's last."""
    with _LOCK:
        attachment = _ATTACHED.get(where)
        if attachment is None:
            return
        attachment.users -= 1
        if attachment.users > 0:
            return
        del _ATTACHED[where]
        try:
            attachment.instance.execute(f"DETACH {_quoted(attachment.alias)}")
        except BaseException:
            _close(attachment.instance)  # whatever state it is in, it is not used again
            raise
        _put_back(attachment.config, attachment.instance)


def attached(where: str) -> bool:
    return where in _ATTACHED
