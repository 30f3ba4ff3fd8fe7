"""The lake's faults as headatlas's errors: the lake backend's one translation function
(``translate``) and the tables of the driver messages it matches.

A lake runs on DuckDB (its lock, commit conflict, snapshot and data-path words:
duckdb_errors.py), with its catalogue in PostgreSQL, reached through DuckDB's PostgreSQL
extension, which raises a plain ``duckdb.Error`` carrying libpq's message with neither SQLSTATE
nor errno: its text is all there is. Each entry of ``CATALOGUE_LOST`` and ``DATA_PATH_FULL`` is
one message (with its SQLSTATE or errno where PostgreSQL or the OS has one);
tests/test_lake_faults.py holds a real message for each. ``probe_data_path`` tells whether a
data path that could not take a file takes one now.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import duckdb

from headatlas.service.errors import (
    RUNS,
    DatabaseFileError,
    DatabaseLocked,
    HeadatlasError,
    Param,
    ParameterError,
    Placeholder,
    StoreConflict,
    StoreError,
    StoreUnavailable,
)
from headatlas.service.storage import duckdb_errors

CATALOGUE = "the lake's catalogue"
DATA_PATH = "the lake's data path"

# A lost or refused catalogue connection.
CATALOGUE_LOST: tuple[tuple[str, str], ...] = (
    ("server closed the connection unexpectedly", "the server ended the session (libpq)"),
    ("terminating connection due to administrator command", "pg_terminate_backend or a shutdown (57P01)"),
    ("terminating connection due to idle-session timeout", "idle_session_timeout (57P05)"),
    ("terminating connection because of crash of another server process", "a server crash (57P02)"),
    ("the database system is shutting down", "a shutdown (57P03)"),
    ("the database system is starting up", "a start (57P03)"),
    ("the database system is not yet accepting connections", "recovery (57P03)"),
    ("the database system is in recovery mode", "recovery (57P03)"),
    ("no connection to the server", "a connection already lost (libpq)"),
    # PostgreSQL's ROLLBACK cannot fail on a live session (even in an aborted transaction): it
    # fails when the session is gone, and libpq's words for it may be empty
    ('Failed to execute query "ROLLBACK"', "a rollback on a session already lost (libpq)"),
    ("could not receive data from server", "the network (libpq)"),
    ("could not send data to server", "the network (libpq)"),
    ("SSL connection has been closed unexpectedly", "the network (libpq)"),
    ("timeout expired", "connect_timeout (libpq)"),
    (os.strerror(errno.ECONNREFUSED), "nothing listening (ECONNREFUSED)"),
    (os.strerror(errno.ECONNRESET), "the network (ECONNRESET)"),
    (os.strerror(errno.ETIMEDOUT), "the network (ETIMEDOUT)"),
    (os.strerror(errno.EHOSTUNREACH), "the network (EHOSTUNREACH)"),
)
# The data path cannot take a file now: DuckDB raises duckdb.IOException with the OS's words for
# the errno (it keeps no errno); a Python OSError keeps its errno.
DATA_PATH_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EDQUOT)
DATA_PATH_FULL: tuple[tuple[str, str], ...] = tuple(
    (os.strerror(code), errno.errorcode[code]) for code in DATA_PATH_ERRNOS
)
PROBE_BYTES = 256 * 1024  # what the data path must take before a paused writer tries its work again


def lake_fault(exc: BaseException, label: str = "the lake") -> StoreUnavailable | None:
    """``exc`` (or the DuckDB error inside SQLAlchemy's) as the lake being unavailable for now —
    its catalogue connection lost or refused, its data path full or read-only — or None. The one
    place that recognises these faults: by type first (an OSError's errno, DuckDB's
    IOException), then by the message, which is all DuckDB keeps of libpq's and the OS's."""
    if isinstance(exc, StoreUnavailable):
        return exc
    fault = _fault(exc, label)
    # a rollback or a close that failed after the fault raises its own error, the fault as its
    # context: the first fault along the chain is the one that happened
    seen = {id(exc)}
    cause = exc.__cause__ or exc.__context__
    while fault is None and _from_driver(exc) and cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        fault = cause if isinstance(cause, StoreUnavailable) else _fault(cause, label)
        cause = cause.__cause__ or cause.__context__
    return fault


def _from_driver(exc: BaseException) -> bool:
    return isinstance(getattr(exc, "orig", None) or exc, duckdb.Error)


def _fault(exc: BaseException, label: str) -> StoreUnavailable | None:
    """``lake_fault`` for ``exc`` alone (not its context)."""
    orig = getattr(exc, "orig", None) or exc
    if isinstance(orig, OSError) and orig.errno in DATA_PATH_ERRNOS:
        detail = f"{orig.strerror}: {orig.filename}" if orig.filename else str(orig.strerror)
        return _unavailable(DATA_PATH, os.strerror(orig.errno), detail, label)
    if not isinstance(orig, duckdb.Error):
        return None
    message = str(orig)
    if isinstance(orig, duckdb.IOException):
        for words, _why in DATA_PATH_FULL:
            if words in message:
                return _unavailable(DATA_PATH, words, _first_line(message), label)
    low = message.lower()
    for words, _why in CATALOGUE_LOST:
        if words.lower() in low:
            return _unavailable(CATALOGUE, words, words, label)
    return None


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), "")[:300]


def _unavailable(waits_for: str, cause: str, detail: str, label: str) -> StoreUnavailable:
    """``cause``: the words matched (what a writer tells apart); ``detail``: what the message shows."""
    if waits_for == CATALOGUE:
        text_ = f"lost the connection to {waits_for} of {label} ({detail}); nothing was committed"
    else:
        text_ = f"{waits_for} of {label} takes no file now ({detail}); nothing was committed"
    return StoreUnavailable(text_, waits_for=waits_for, cause=cause)


def translate(exc: BaseException, label: str, *, at: int | None = None) -> HeadatlasError | None:
    """``exc`` (a driver's error, bare or inside SQLAlchemy's) as headatlas's error about the lake
    ``label``, or None when it is none of these (the caller's own message then):

    - the lake unavailable for now (``lake_fault``: its catalogue's connection lost or refused,
      its data path full or read-only): ``StoreUnavailable``, tried again when it clears;
    - its catalogue file held by another process (a file catalogue): ``DatabaseLocked``;
    - a commit refused for a concurrent change of the same rows: ``StoreConflict``, tried again;
    - ``at`` (``--at``) a snapshot the lake does not have: ``ParameterError``;
    - a new lake attached without a data path: ``DatabaseFileError`` naming --data-path.

    The lost catalogue first: a commit that lost it is refused in the words of a conflict too."""
    if isinstance(exc, StoreError):
        return None
    fault = lake_fault(exc, label)
    if fault is not None:
        return fault
    if duckdb_errors.is_lock_conflict(exc):
        return DatabaseLocked(
            f"{label} is busy: another process holds its catalogue file; retry when that process finishes"
        )
    if duckdb_errors.is_commit_conflict(exc):
        return StoreConflict(
            f"{label}: a concurrent transaction changed the same rows; the unit of work is tried again"
        )
    if at is not None and duckdb_errors.is_missing_snapshot(exc):
        return ParameterError(
            Param("at", at),
            f": no such snapshot in {label} ({duckdb_errors.first_line(exc)[:200]})",
            hint=("see ", RUNS),
        )
    if duckdb_errors.is_new_lake_without_data_path(exc):
        return DatabaseFileError(
            f"{label} is a new lake: pass ",
            Param("data_path", Placeholder("FOLDER")),
            " (or set HEADATLAS_DATA_PATH), the folder or shared mount where its Parquet files go",
        )
    return None


def probe_data_path(folder: str, label: str) -> None:
    """Raise StoreUnavailable while the local folder ``folder``, the data path of the lake
    ``label``, takes no file: by writing and removing a file of a few blocks there (a full or
    read-only one refuses it)."""
    probe = Path(folder) / f".headatlas-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as out:
            out.write(b"\0" * PROBE_BYTES)
            out.flush()
            os.fsync(out.fileno())
    except OSError as exc:
        raise lake_fault(exc, label) or StoreUnavailable(
            f"{DATA_PATH} of {label} takes no file now ({exc.strerror})", waits_for=DATA_PATH
        ) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
