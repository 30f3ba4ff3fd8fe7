"""What the lake backend makes of its faults (``lake_errors.lake_fault``, the one place that recognises
them): each message it matches, as DuckDB raises it, is a lake unavailable for now (its
catalogue, or its data path); errors that retrying cannot cure are not. Then the faults
themselves, in-process on this machine's PostgreSQL: the writer's catalogue session ended by
the server (``pg_terminate_backend``) and a data path that takes no file."""

from __future__ import annotations

import errno
import os

import duckdb
import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError

from headatlas.service.errors import StoreUnavailable
from headatlas.service.storage.backends import lake_errors
from headatlas.service.storage.backends.lake_errors import CATALOGUE, DATA_PATH, lake_fault

# one real message for each entry of CATALOGUE_LOST, as DuckDB's PostgreSQL extension words it
CATALOGUE_MESSAGES = {
    "server closed the connection unexpectedly": (
        'Failed to query most recent snapshot for DuckLake: Failed to execute query "BEGIN TRANSACTION ISOLATION '
        'LEVEL REPEATABLE READ": server closed the connection unexpectedly\n\tThis probably means the server '
        "terminated abnormally\n\tbefore or while processing the request."
    ),
    "terminating connection due to administrator command": (
        'Failed to execute query "COMMIT": FATAL:  terminating connection due to administrator command'
    ),
    "terminating connection due to idle-session timeout": (
        'Failed to execute query "BEGIN TRANSACTION": FATAL:  terminating connection due to idle-session timeout'
    ),
    "terminating connection because of crash of another server process": (
        "Failed to execute query: WARNING:  terminating connection because of crash of another server process"
    ),
    "the database system is shutting down": (
        'IO Error: Unable to connect to Postgres at "dbname=atlas host=db": connection to server at "db" '
        "(10.0.0.2), port 5432 failed: FATAL:  the database system is shutting down"
    ),
    "the database system is starting up": (
        'IO Error: Unable to connect to Postgres at "dbname=atlas": connection to server on socket '
        '"/run/postgresql/.s.PGSQL.5432" failed: FATAL:  the database system is starting up'
    ),
    "the database system is not yet accepting connections": (
        'IO Error: Unable to connect to Postgres at "dbname=atlas": connection to server at "db", port 5432 '
        "failed: FATAL:  the database system is not yet accepting connections\nDETAIL:  Consistent recovery "
        "state has not been yet reached."
    ),
    "the database system is in recovery mode": (
        'IO Error: Unable to connect to Postgres at "dbname=atlas": FATAL:  the database system is in recovery mode'
    ),
    "no connection to the server": 'Failed to execute query "SELECT 1": no connection to the server',
    'Failed to execute query "ROLLBACK"': 'TransactionContext Error: Failed to rollback: Failed to execute query "ROLLBACK": ',
    "could not receive data from server": (
        'Failed to execute query "COMMIT": could not receive data from server: Connection timed out'
    ),
    "could not send data to server": 'Failed to execute query "BEGIN": could not send data to server: Broken pipe',
    "SSL connection has been closed unexpectedly": (
        'Failed to execute query "SELECT 1": SSL connection has been closed unexpectedly'
    ),
    "timeout expired": 'IO Error: Unable to connect to Postgres at "dbname=atlas host=10.9.9.9": timeout expired',
    os.strerror(errno.ECONNREFUSED): (
        'IO Error: Failed to attach DuckLake MetaData "__ducklake_metadata_lake" at path + "postgres:dbname=atlas '
        'host=127.0.0.1 port=1 user=postgres"Unable to connect to Postgres at "dbname=atlas host=127.0.0.1 port=1 '
        'user=postgres": connection to server at "127.0.0.1", port 1 failed: Connection refused\n\tIs the server '
        "running on that host and accepting TCP/IP connections?"
    ),
    os.strerror(errno.ECONNRESET): ('Failed to execute query "COMMIT": could not receive: Connection reset by peer'),
    os.strerror(errno.ETIMEDOUT): (
        'IO Error: Unable to connect to Postgres at "dbname=atlas host=db": connection to server at "db" '
        "(10.0.0.2), port 5432 failed: Connection timed out"
    ),
    os.strerror(errno.EHOSTUNREACH): (
        'IO Error: Unable to connect to Postgres at "host=db": connection to server at "db" (10.0.0.2), port '
        "5432 failed: No route to host"
    ),
}
# one for each entry of DATA_PATH_FULL, as DuckDB words a failed Parquet write (an IOException)
DATA_PATH_MESSAGES = {
    os.strerror(errno.ENOSPC): (
        'IO Error: Could not write file "/lake/main/batches/ducklake-01a2.parquet": No space left on device'
    ),
    os.strerror(errno.EROFS): (
        'IO Error: Cannot open file "/lake/main/batches/ducklake-01a2.parquet": Read-only file system'
    ),
    os.strerror(errno.EDQUOT): ('IO Error: Could not write file "/lake/main/batches/ducklake-01a2.parquet": ')
    + os.strerror(errno.EDQUOT),
}


def test_every_message_matched_has_a_test():
    assert set(CATALOGUE_MESSAGES) == {words for words, _why in lake_errors.CATALOGUE_LOST}
    assert set(DATA_PATH_MESSAGES) == {words for words, _why in lake_errors.DATA_PATH_FULL}


@pytest.mark.parametrize("words", sorted(CATALOGUE_MESSAGES))
def test_a_lost_catalogue_connection_is_the_catalogue_unavailable(words):
    error = duckdb.Error(CATALOGUE_MESSAGES[words])
    for raised in (error, DBAPIError("USE lake", None, error)):  # bare, and as SQLAlchemy wraps it
        fault = lake_fault(raised, "ducklake:postgres:dbname=atlas")
        assert isinstance(fault, StoreUnavailable), words
        assert fault.waits_for == CATALOGUE and fault.cause == words
        assert "ducklake:postgres:dbname=atlas" in str(fault) and "nothing was committed" in str(fault)


def test_a_rollback_that_failed_after_a_lost_catalogue_is_the_catalogue_unavailable():
    """SQLAlchemy rolls back when a statement meets a session the server ended; that rollback
    fails too (its words name no fault) and is what propagates, the lost session as its context."""
    lost = DBAPIError("USE lake", None, duckdb.Error(CATALOGUE_MESSAGES["server closed the connection unexpectedly"]))
    rollback = duckdb.Error("TransactionContext Error: Failed to rollback: current transaction is aborted")
    try:
        try:
            raise lost
        except DBAPIError:
            raise DBAPIError("ROLLBACK", None, rollback)  # noqa: B904 - as a failed rollback raises
    except DBAPIError as raised:
        fault = lake_fault(raised, "ducklake:postgres:dbname=atlas")
    assert isinstance(fault, StoreUnavailable) and fault.waits_for == CATALOGUE
    assert fault.cause == "server closed the connection unexpectedly"
    # an error of the caller's own, raised while handling a lost catalogue, stays its own
    try:
        try:
            raise lost
        except DBAPIError:
            raise ValueError("a bug")  # noqa: B904
    except ValueError as raised:
        assert lake_fault(raised) is None


@pytest.mark.parametrize("words", sorted(DATA_PATH_MESSAGES))
def test_a_data_path_that_takes_no_file_is_the_data_path_unavailable(words):
    fault = lake_fault(duckdb.IOException(DATA_PATH_MESSAGES[words]))
    assert isinstance(fault, StoreUnavailable) and fault.waits_for == DATA_PATH
    assert fault.cause == words and "/lake/main/batches/ducklake-01a2.parquet" in str(fault)


@pytest.mark.parametrize("code", lake_errors.DATA_PATH_ERRNOS)
def test_an_os_error_is_known_by_its_errno(code):
    fault = lake_fault(OSError(code, "whatever the platform says", "/lake/x.parquet"))
    assert fault is not None and fault.waits_for == DATA_PATH and "/lake/x.parquet" in str(fault)
    assert fault.cause == os.strerror(code)


@pytest.mark.parametrize(
    "error",
    [
        # retrying cannot cure these: they stay errors
        duckdb.IOException(
            'IO Error: Unable to connect to Postgres at "dbname=nosuch": connection to server at "127.0.0.1", '
            'port 5432 failed: FATAL:  database "nosuch" does not exist'
        ),
        duckdb.IOException(
            'IO Error: Unable to connect to Postgres at "user=x": FATAL:  password authentication failed for user "x"'
        ),
        duckdb.IOException('IO Error: Cannot open file "/lake/main/x.parquet": Permission denied'),
        duckdb.IOException('IO Error: No files found that match the pattern "/lake/main/x.parquet"'),
        duckdb.Error("TransactionContext Error: Failed to commit: Transaction conflict on the same row"),
        duckdb.CatalogException("Catalog Error: Table with name nosuch does not exist!"),
        # the words of a full disk, but not from a file DuckDB wrote (a user's string in a query)
        duckdb.BinderException('Binder Error: column "No space left on device" not found'),
        OSError(errno.EACCES, "Permission denied"),
        ValueError("server closed the connection unexpectedly"),  # not the driver's
    ],
    ids=lambda e: type(e).__name__,
)
def test_other_errors_are_not_an_unavailable_lake(error):
    assert lake_fault(error) is None


def test_a_catalogue_session_ended_by_the_server_is_reattached(lake):
    """pg_terminate_backend on every session of the lake's catalogue (what a PostgreSQL restart
    or idle_session_timeout does to them): the next transaction reports the catalogue
    unavailable, not a raw DBAPIError, and the one after attaches afresh and works."""
    import lake_support

    backend = lake.backend()
    with backend.transaction(read_only=True) as conn:
        before = conn.execute(text("SELECT count(*) FROM runs")).scalar()
    ended = lake_support._psql(
        f"SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = '{lake.name}' "
        "AND pid <> pg_backend_pid()"
    )
    assert ended.returncode == 0 and int(ended.stdout) > 0, ended.stderr
    with pytest.raises(StoreUnavailable) as caught:
        with backend.transaction(read_only=True) as conn:
            conn.execute(text("SELECT count(*) FROM runs")).scalar()
    assert caught.value.waits_for == CATALOGUE
    with backend.transaction(read_only=True) as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == before


def test_catalogue_sessions_ended_by_idle_session_timeout_are_reattached(lake):
    """PostgreSQL's idle_session_timeout ends the lake's sessions while the process sits idle: the
    next transaction reports the catalogue unavailable, the one after attaches afresh."""
    import time

    import lake_support

    def alter(setting: str) -> None:
        done = lake_support._psql(f'ALTER DATABASE "{lake.name}" {setting}')
        assert done.returncode == 0, done.stderr

    backend = lake.backend()
    alter("SET idle_session_timeout = '1s'")
    lake.release()  # sessions opened from now on end after 1 s idle
    with backend.transaction(read_only=True) as conn:
        before = conn.execute(text("SELECT count(*) FROM runs")).scalar()
    alter("RESET idle_session_timeout")  # the sessions attached afresh keep theirs
    time.sleep(2.5)
    with pytest.raises(StoreUnavailable) as caught:
        with backend.transaction(read_only=True) as conn:
            conn.execute(text("SELECT count(*) FROM runs")).scalar()
    assert caught.value.waits_for == CATALOGUE
    with backend.transaction(read_only=True) as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == before
