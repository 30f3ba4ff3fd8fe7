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
_IDLE: list[_Kept] = []  # instances with no file attached, the most recently used last
_ATTACHED: dict[str, _Attachment] = {}  # absolute path -> its attachment
_FORKED: list[Any] = []  # a forked child's inherited instances: referenced, never closed


class _Kept:
    """An instance, the configuration it was made with, and its settings then (restored before reuse)."""

    def __init__(self, config: tuple) -> None:
        self.config = config
        self.instance = duckdb.connect(":memory:", config=dict(config))
        self.settings = _settings(self.instance)


class _Attachment:
    def __init__(self, kept: _Kept, alias: str, read_only: bool) -> None:
        self.kept, self.alias, self.read_only = kept, alias, read_only
        self.users = 0
        # a statement ran that may have changed a global setting (SET, RESET, PRAGMA …), or a
        # cursor was handed out whose statements are not seen: the settings are compared (and
        # restored) before the instance is kept. Most transactions run none of these, and reading
        # the settings back after each was 2 % of the test suite's CPU (docs/testing.md, 2026-12-07)
        self.dirty = False


# first words of statements that change no global setting: any other, or several statements in
# one call, has the instance's settings compared before it is kept for the next file
_SETTLED = frozenset(
    "SELECT INSERT UPDATE DELETE WITH CREATE DROP ALTER BEGIN COMMIT ROLLBACK ABORT CHECKPOINT FROM "
    "VALUES TRUNCATE DESCRIBE SHOW SUMMARIZE EXPLAIN COPY USE".split()
)


def _settled(statement: object) -> bool:
    """Whether ``statement`` surely changes no global setting: one statement whose first word is
    one of ``_SETTLED`` (a comment first, ``;`` inside, or anything else: not sure)."""
    if not isinstance(statement, str):
        return False
    body = statement.strip().rstrip(";")
    if ";" in body:
        return False
    first = body.split(None, 1)[0].upper() if body else ""
    return first.lstrip("(") in _SETTLED


def _forget() -> None:
    _FORKED.extend(kept.instance for kept in _IDLE)
    _FORKED.extend(a.kept.instance for a in _ATTACHED.values())
    _IDLE.clear()
    _ATTACHED.clear()
    _LOCK._at_fork_reinit()  # type: ignore[attr-defined]


os.register_at_fork(after_in_child=_forget)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def alias_of(where: str) -> str | None:
    """The name DuckDB gives the file when it opens it (its name up to the first dot); None where an
    instance's own catalogue has that name (the file is then opened on an instance of its own)."""
    name = Path(where).name.split(".", 1)[0]
    return None if not name or name.lower() in RESERVED else name


class AttachedConnection:
    """A connection on a kept instance, in the file's database; ``close`` ends this process's use
    of the file when it is the last (the file detached: checkpointed, its lock released)."""

    def __init__(self, cursor: duckdb.DuckDBPyConnection, where: str, attachment: _Attachment):
        self._cursor: duckdb.DuckDBPyConnection | None = cursor
        self._where, self._alias, self._attachment = where, attachment.alias, attachment

    def __getattr__(self, name: str) -> Any:
        if self._cursor is None:
            raise duckdb.ConnectionException("Connection already closed!")
        if name in _UNSEEN:  # runs SQL this class does not read: settings compared at the end
            self._attachment.dirty = True
        return getattr(self._cursor, name)

    def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
        if self._cursor is None:
            raise duckdb.ConnectionException("Connection already closed!")
        if not _settled(statement):
            self._attachment.dirty = True
        return self._cursor.execute(statement, *args, **kwargs)

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """Another connection on the instance, in the file's database too (a new one starts in
        ``memory``). Its statements are not seen: the settings are compared when the file is let go."""
        assert self._cursor is not None
        self._attachment.dirty = True
        return _in(self._cursor.cursor(), self._alias)

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


# a connection's methods that run SQL text other than through ``execute``
_UNSEEN = frozenset({"executemany", "sql", "query", "from_query", "load_extension", "install_extension"})


def _in(cursor: duckdb.DuckDBPyConnection, alias: str) -> duckdb.DuckDBPyConnection:
    cursor.execute(f"USE {_quoted(alias)}")
    return cursor


def _take(config: tuple) -> _Kept:
    for i, kept in enumerate(_IDLE):
        if kept.config == config:
            return _IDLE.pop(i)
    return _Kept(config)


def _settings(instance: duckdb.DuckDBPyConnection) -> dict[str, str]:
    return dict(instance.execute("SELECT name, value FROM duckdb_settings()").fetchall())


def _put_back(kept: _Kept, *, dirty: bool = True) -> None:
    """Keep the empty instance for the next file, its settings as they were made: a transaction's
    ``SET`` of a global option (storing's ``threads``) ends with its file, as it did when the file
    closed with its instance. One whose settings cannot be restored is closed. ``dirty``: a
    statement may have changed them (``_Attachment.dirty``); else they are not read again."""
    instance, made = kept.instance, kept.settings
    try:
        now = _settings(instance) if dirty else made  # read where a statement may have changed them
        if now != made:
            for name, value in now.items():
                if name in made and made[name] != value:
                    instance.execute(f"SET GLOBAL {name} = ?", [made[name]])
            if _settings(instance) != made:
                raise duckdb.Error("settings not restored")
    except duckdb.Error:
        instance.close()
        return
    _IDLE.append(kept)
    while len(_IDLE) > _IDLE_KEPT:
        _IDLE.pop(0).instance.close()


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
            kept = _take(tuple(sorted(duckdb_config().items())))
            try:
                attach(kept.instance, where, alias, read_only=read_only)
            except BaseException:
                _put_back(kept)
                raise
            attachment = _ATTACHED[where] = _Attachment(kept, alias, read_only)
        cursor = attachment.kept.instance.cursor()
        attachment.users += 1
        try:
            _in(cursor, attachment.alias)
        except BaseException:
            cursor.close()
            release(where)
            raise
        # a connection's methods, by delegation to its cursor: typed as one
        return cast(duckdb.DuckDBPyConnection, AttachedConnection(cursor, where, attachment))


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
            attachment.kept.instance.execute(f"DETACH {_quoted(attachment.alias)}")
        except BaseException:
            attachment.kept.instance.close()  # whatever state it is in, it is not used again
            raise
        _put_back(attachment.kept, dirty=attachment.dirty)


def attached(where: str) -> bool:
    return where in _ATTACHED
