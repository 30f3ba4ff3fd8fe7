"""DuckDB's errors told apart, for both backends (each runs on DuckDB).

A leaf of the storage package (it imports only duckdb and SQLAlchemy). DuckDB raises an exception class per kind of error (``duckdb.IOException``,
``TransactionException``, ``InvalidInputException`` …) and no error code; several faults share a
class. Where the class is not enough, the words DuckDB (or its DuckLake extension) writes for the
one fault are matched here, and nowhere else: ``MATCHED`` lists each, with the class it comes
in, and tests/test_error_translation.py holds a real message for each. The backends' translation
functions (``dbfile.translate``, ``lake_errors.translate``) turn what these recognise into
headatlas's error types.
"""

from __future__ import annotations

import duckdb
from sqlalchemy.exc import DBAPIError

# Another process holds the file: DuckDB lets one process open a file for writing and refuses
# every other one meanwhile, even read-only (an IOException when opening, a TransactionException
# when a commit meets the lock on the .wal file).
LOCK_HELD = "Could not set lock on file"
# DuckLake refused a commit: a transaction committed since this one began changed the same rows
# (the words of each kind of conflict begin so), or it gave up retrying them.
CONFLICT = "Transaction conflict"
COMMIT_REFUSED = "Failed to commit DuckLake transaction"
# ``--at`` names a snapshot the lake does not have (a version or a time).
NO_SNAPSHOT = "No snapshot found at"
# a new lake attached without a folder for its data files
NO_DATA_PATH = "data_path is not set"

MATCHED: tuple[tuple[str, tuple[type[duckdb.Error], ...]], ...] = (
    (LOCK_HELD, (duckdb.IOException, duckdb.TransactionException)),
    (CONFLICT, (duckdb.TransactionException,)),
    (COMMIT_REFUSED, (duckdb.TransactionException,)),
    (NO_SNAPSHOT, (duckdb.InvalidInputException,)),
    (NO_DATA_PATH, (duckdb.InvalidInputException,)),
)


def driver_error(exc: BaseException) -> BaseException:
    """The DuckDB error inside SQLAlchemy's wrapper (``DBAPIError.orig``), else ``exc``."""
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    return orig if isinstance(orig, BaseException) else exc


def _says(exc: BaseException, words: str, classes: tuple[type[duckdb.Error], ...]) -> bool:
    error = driver_error(exc)
    return isinstance(error, classes) and words in str(error)


def is_lock_conflict(exc: BaseException) -> bool:
    """Another process holds the database file (or a lake's catalogue file): wait for it."""
    return _says(exc, LOCK_HELD, (duckdb.IOException, duckdb.TransactionException))


def is_commit_conflict(exc: BaseException) -> bool:
    """A lake refused the commit for a concurrent change of the same rows: try the unit of work
    again. (A commit refused because the catalogue's connection was lost says so too: the lake's
    translation asks ``lake_fault`` first.)"""
    return _says(exc, CONFLICT, (duckdb.TransactionException,)) or _says(
        exc, COMMIT_REFUSED, (duckdb.TransactionException,)
    )


def is_missing_snapshot(exc: BaseException) -> bool:
    return _says(exc, NO_SNAPSHOT, (duckdb.InvalidInputException,))


def is_new_lake_without_data_path(exc: BaseException) -> bool:
    return _says(exc, NO_DATA_PATH, (duckdb.InvalidInputException,))


def first_line(exc: BaseException) -> str:
    """The error's first non-empty line (DuckDB's messages run on with hints), or its class."""
    error = driver_error(exc)
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
