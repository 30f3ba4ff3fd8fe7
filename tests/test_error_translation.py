"""Errors are types: what the backends' translation functions (``dbfile.translate``,
``lake_errors.translate``, on ``duckdb_errors``) make of DuckDB's errors, with a real message for
every words they match, and messages that merely share a word with one passing as they are; the
same errors raised for real (a file held by another process, a DuckLake commit conflict, a
snapshot that is not there); and a device out of memory known by torch's type alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import duckdb
import pytest
import torch
from sqlalchemy.exc import DBAPIError

from headatlas.service.errors import (
    DatabaseFileError,
    DatabaseLocked,
    ParameterError,
    StoreBusy,
    StoreConflict,
    StoreUnavailable,
)
from headatlas.service.storage import dbfile, duckdb_errors
from headatlas.service.storage.backends import lake_errors

LAKE = "ducklake:postgres:dbname=atlas"
HELD = "Conflicting lock is held in /usr/bin/python3.11 (PID 7733). See also https://duckdb.org/docs/stable/connect/concurrency"

# one real message (as DuckDB 1.4 and its DuckLake extension raise it) for each words matched
REAL = {
    duckdb_errors.LOCK_HELD: [
        duckdb.IOException(f'IO Error: Could not set lock on file "/data/atlas.duckdb": {HELD}'),
        duckdb.TransactionException(f'Failed to commit: Could not set lock on file "atlas.duckdb.wal": {HELD}'),
        duckdb.IOException(
            'IO Error: Failed to attach DuckLake MetaData "__ducklake_metadata_lake" at path + "cat.ducklake"'
            f'Could not set lock on file "cat.ducklake": {HELD}'
        ),
    ],
    duckdb_errors.CONFLICT: [
        duckdb.TransactionException(
            "TransactionContext Error: Failed to commit: Failed to commit DuckLake transaction.\nTransaction conflict - "
            'attempting to delete from file with index "0" - but another transaction has deleted from it'
        ),
        duckdb.TransactionException(
            'TransactionContext Error: Failed to commit: Transaction conflict: attempting to insert into table "runs" '
            "but it has been dropped by a different transaction"
        ),
    ],
    duckdb_errors.COMMIT_REFUSED: [
        duckdb.TransactionException(
            "TransactionContext Error: Failed to commit: Failed to commit DuckLake transaction - failed to get "
            "snapshot and snapshot changes for conflict resolution: Catalog Error: no snapshot 12"
        ),
    ],
    duckdb_errors.NO_SNAPSHOT: [
        duckdb.InvalidInputException("Invalid Input Error: No snapshot found at version 999"),
        duckdb.InvalidInputException("Invalid Input Error: No snapshot found at timestamp 2000-01-01 00:00:00+00"),
    ],
    duckdb_errors.NO_DATA_PATH: [
        duckdb.InvalidInputException(
            "Invalid Input Error: Attempting to create a new ducklake instance but data_path is not set - set the "
            "DATA_PATH parameter to the desired location of the data files"
        ),
    ],
}

# errors that share a word (or the words, from elsewhere) with one matched, and are none of them
NOT_A_LOCK = [
    duckdb.IOException('IO Error: Cannot open file "/data/lock.parquet": No such file or directory'),
    duckdb.CatalogException("Catalog Error: Table with name lock does not exist!"),
    duckdb.InvalidInputException("Invalid Input Error: Cannot change threads - configuration has been locked"),
    duckdb.IOException("IO Error: the lock file of the spool could not be read"),
    duckdb.BinderException('Binder Error: Referenced column "Could not set lock on file" not found'),  # a user's words
    ValueError("Could not set lock on file x"),  # not the driver's
]


def test_every_words_matched_has_a_real_message():
    assert set(REAL) == {words for words, _classes in duckdb_errors.MATCHED}
    for words, classes in duckdb_errors.MATCHED:
        for error in REAL[words]:
            assert words in str(error) and isinstance(error, classes), words


@pytest.mark.parametrize("error", REAL[duckdb_errors.LOCK_HELD], ids=lambda e: type(e).__name__)
def test_a_file_held_by_another_process_is_database_locked(error):
    for raised in (error, DBAPIError("COMMIT", None, error)):  # bare, and as SQLAlchemy wraps it
        assert duckdb_errors.is_lock_conflict(raised)
        translated = dbfile.translate("/data/atlas.duckdb", raised)
        assert isinstance(translated, DatabaseLocked) and isinstance(translated, StoreBusy)
        assert "nothing was written, retry" in str(translated)
        assert isinstance(lake_errors.translate(raised, LAKE), DatabaseLocked)


@pytest.mark.parametrize("error", NOT_A_LOCK, ids=lambda e: f"{type(e).__name__}:{str(e)[:24]}")
def test_a_message_that_merely_says_lock_is_not_a_lock_conflict(error):
    assert not duckdb_errors.is_lock_conflict(error)
    assert not isinstance(dbfile.translate("/data/atlas.duckdb", error), StoreBusy)
    assert lake_errors.translate(error, LAKE) is None


@pytest.mark.parametrize(
    "error", REAL[duckdb_errors.CONFLICT] + REAL[duckdb_errors.COMMIT_REFUSED], ids=lambda e: str(e)[40:80]
)
def test_a_commit_refused_for_a_concurrent_change_is_a_store_conflict(error):
    for raised in (error, DBAPIError("COMMIT", None, error)):
        translated = lake_errors.translate(raised, LAKE)
        assert isinstance(translated, StoreConflict) and "tried again" in str(translated)


def test_a_commit_that_lost_its_catalogue_is_unavailable_not_a_conflict():
    lost = duckdb.TransactionException(
        'Failed to commit DuckLake transaction. Failed to execute query "COMMIT": server closed the connection '
        "unexpectedly\n\tThis probably means the server terminated abnormally"
    )
    translated = lake_errors.translate(lost, LAKE)
    assert isinstance(translated, StoreUnavailable) and translated.waits_for == lake_errors.CATALOGUE


@pytest.mark.parametrize(
    "error",
    [
        duckdb.TransactionException("TransactionContext Error: cannot start a transaction within a transaction"),
        duckdb.Error("TransactionContext Error: Failed to commit: Transaction conflict on the same row"),  # class
        duckdb.ConstraintException('Constraint Error: Duplicate key "run_id: 1" violates primary key constraint'),
    ],
    ids=lambda e: type(e).__name__,
)
def test_other_transaction_errors_are_no_conflict(error):
    assert not duckdb_errors.is_commit_conflict(error)
    assert lake_errors.translate(error, LAKE) is None


@pytest.mark.parametrize("error", REAL[duckdb_errors.NO_SNAPSHOT], ids=lambda e: str(e)[-30:])
def test_a_snapshot_the_lake_does_not_have_is_a_parameter_error_of_at(error):
    translated = lake_errors.translate(error, LAKE, at=999)
    assert isinstance(translated, ParameterError) and str(translated).startswith("--at 999: no such snapshot")
    assert lake_errors.translate(error, LAKE) is None  # without --at it is not the user's value


def test_a_new_lake_without_a_data_path_names_the_option():
    translated = lake_errors.translate(REAL[duckdb_errors.NO_DATA_PATH][0], LAKE)
    assert isinstance(translated, DatabaseFileError) and "--data-path" in str(translated)


def test_a_file_held_for_real_by_another_process_is_database_locked(tmp_path):
    """The error DuckDB raises here, in this version, is the one the table above matches."""
    path = tmp_path / "held.duckdb"
    duckdb.connect(str(path)).close()
    hold = textwrap.dedent(
        """
        import sys, time, duckdb
        connection = duckdb.connect(sys.argv[1])
        print("held", flush=True)
        sys.stdin.read()
        """
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(duckdb.Error) as refused:
            duckdb.connect(str(path), read_only=True)
    finally:
        holder.communicate("", timeout=30)
    assert duckdb_errors.is_lock_conflict(refused.value)
    assert isinstance(dbfile.translate(path, refused.value), DatabaseLocked)


def test_a_ducklake_commit_conflict_and_a_missing_snapshot_raised_for_real(tmp_path):
    """Two transactions of one lake delete the same row: the second commit is refused in the words
    matched; attaching at a snapshot the lake does not have is refused in its own."""
    from headatlas.service.storage.backends.base import duckdb_config

    connection = duckdb.connect(config=duckdb_config())
    try:
        connection.execute("LOAD ducklake")
        catalogue, data = tmp_path / "c.ducklake", tmp_path / "data"
        connection.execute(f"ATTACH 'ducklake:{catalogue}' AS lake (DATA_PATH '{data}/')")
        connection.execute("CREATE TABLE lake.t (x INTEGER)")
        connection.execute("INSERT INTO lake.t VALUES (1), (2)")
        first, second = connection.cursor(), connection.cursor()
        for cursor in (first, second):
            cursor.execute("BEGIN")
            cursor.execute("DELETE FROM lake.t WHERE x = 1")
        first.execute("COMMIT")
        with pytest.raises(duckdb.Error) as refused:
            second.execute("COMMIT")
        assert isinstance(lake_errors.translate(refused.value, LAKE), StoreConflict)
        connection.execute("DETACH lake")
        with pytest.raises(duckdb.Error) as missing:
            connection.execute(f"ATTACH 'ducklake:{catalogue}' AS old (READ_ONLY, SNAPSHOT_VERSION 999)")
        assert isinstance(lake_errors.translate(missing.value, LAKE, at=999), ParameterError)
    finally:
        connection.close()


# --- out of device memory -------------------------------------------------------------------------
def test_out_of_memory_is_known_by_torch_type_alone():
    from headatlas.service.engine.analysis import _is_out_of_memory

    assert _is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert _is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert not _is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))  # words alone
    assert not _is_out_of_memory(ValueError("the corpus ran out of memory of its author"))
