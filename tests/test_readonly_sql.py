"""Raw SQL over the results database: read-only, confined to the file, capped, time-limited."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import pytest

from headatlas.service.errors import ParameterError, StoreError
from headatlas.service.storage.readonly import (
    QueryResult,
    check_select_only,
    connect_readonly,
    retry_on_lock,
    run_readonly_sql,
)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built once: no test here may change it, and the refusal tests check that it is unchanged.
    path = tmp_path_factory.mktemp("store") / "results.duckdb"
    connection = duckdb.connect(str(path))
    connection.execute("CREATE TABLE heads (layer INTEGER, head INTEGER, score DOUBLE)")
    connection.execute("INSERT INTO heads SELECT l, h, l * 10 + h FROM range(6) a(l), range(12) b(h)")
    connection.execute("CREATE TABLE runs (run_id INTEGER, model VARCHAR)")
    connection.execute("INSERT INTO runs VALUES (1, 'minilm'), (2, 'bert-base')")
    connection.close()
    return path


def snapshot(path: Path) -> dict[str, int]:
    """Table name -> row count, read outside the code under test."""
    connection = duckdb.connect(str(path), read_only=True)
    try:
        tables = [name for (name,) in connection.execute("SHOW TABLES").fetchall()]
        return {name: connection.execute(f'SELECT count(*) FROM "{name}"').fetchone()[0] for name in tables}
    finally:
        connection.close()


# --- queries that run -------------------------------------------------------------------


def test_select_returns_columns_and_rows(db_path: Path) -> None:
    result = run_readonly_sql(db_path, "SELECT run_id, model FROM runs ORDER BY run_id;")
    assert isinstance(result, QueryResult)
    assert result.columns == ["run_id", "model"]
    assert result.rows == [(1, "minilm"), (2, "bert-base")]
    assert result.truncated is False
    assert result.elapsed_s >= 0


def test_with_select_runs(db_path: Path) -> None:
    sql = """
        WITH top AS (SELECT layer, max(score) AS best FROM heads GROUP BY layer)
        SELECT layer, best FROM top WHERE layer < 2 ORDER BY layer
    """
    result = run_readonly_sql(db_path, sql)
    assert result.columns == ["layer", "best"]
    assert result.rows == [(0, 11.0), (1, 21.0)]


def test_named_and_positional_params(db_path: Path) -> None:
    named = run_readonly_sql(
        db_path,
        "SELECT head FROM heads WHERE layer = $layer AND head < $h ORDER BY head",
        params={"layer": 3, "h": 2},
    )
    assert named.rows == [(0,), (1,)]
    positional = run_readonly_sql(db_path, "SELECT model FROM runs WHERE run_id = ?", params=[2])
    assert positional.rows == [("bert-base",)]


def test_row_cap_sets_truncated(db_path: Path) -> None:
    capped = run_readonly_sql(db_path, "SELECT * FROM heads", max_rows=10)
    assert len(capped.rows) == 10 and capped.truncated is True
    exact = run_readonly_sql(db_path, "SELECT * FROM heads", max_rows=72)
    assert len(exact.rows) == 72 and exact.truncated is False


def test_check_select_only_strips_trailing_semicolon() -> None:
    assert check_select_only("  SELECT 1 ;  ") == "SELECT 1"
    assert check_select_only("WITH a AS (SELECT 1 AS x) SELECT x FROM a;") == (
        "WITH a AS (SELECT 1 AS x) SELECT x FROM a"
    )


# --- statements that are refused --------------------------------------------------------

REFUSED = {
    "create": ("CREATE TABLE x (a INTEGER)", "CREATE"),
    "create_as": ("CREATE TABLE x AS SELECT * FROM runs", "CREATE"),
    "drop": ("DROP TABLE runs", "DROP"),
    "insert": ("INSERT INTO runs VALUES (3, 'x')", "INSERT"),
    "with_insert": ("WITH a AS (SELECT 3, 'x') INSERT INTO runs SELECT * FROM a", "INSERT"),
    "update": ("UPDATE runs SET model = 'x'", "UPDATE"),
    "delete": ("DELETE FROM heads", "DELETE"),
    "alter": ("ALTER TABLE runs ADD COLUMN extra INTEGER", "ALTER"),
    "copy_to": ("COPY runs TO '/tmp/headatlas-leak.csv'", "COPY"),
    "copy_from": ("COPY runs FROM '/etc/passwd'", "COPY"),
    "attach": ("ATTACH '/tmp/other.duckdb' AS other", "ATTACH"),
    "detach": ("DETACH results", "DETACH"),
    "install": ("INSTALL httpfs", "INSTALL"),
    "load": ("LOAD httpfs", "LOAD"),
    "set": ("SET threads = 1", "SET"),
    "set_external": ("SET enable_external_access = true", "SET"),
    "reset": ("RESET lock_configuration", "RESET"),
    "pragma": ("PRAGMA enable_profiling", "PRAGMA"),
    "export": ("EXPORT DATABASE '/tmp/headatlas-export'", "EXPORT"),
    "import": ("IMPORT DATABASE '/tmp/headatlas-export'", "IMPORT"),
    "call": ("CALL pragma_version()", "CALL"),
    "checkpoint": ("CHECKPOINT", "CHECKPOINT"),
    "vacuum": ("VACUUM", "VACUUM"),
    "explain_analyze": ("EXPLAIN ANALYZE SELECT 1", "EXPLAIN"),
    "begin": ("BEGIN TRANSACTION", "BEGIN"),
    "update_extensions": ("UPDATE EXTENSIONS", "UPDATE"),  # unknown to duckdb's Python enum
}


@pytest.mark.parametrize("sql, kind", REFUSED.values(), ids=REFUSED.keys())
def test_non_select_statements_are_refused(db_path: Path, sql: str, kind: str) -> None:
    before = snapshot(db_path)
    with pytest.raises(StoreError) as caught:
        run_readonly_sql(db_path, sql)
    message = str(caught.value)
    assert message.startswith("refused:") and "\n" not in message
    assert f"got {kind}" in message
    assert snapshot(db_path) == before


@pytest.mark.parametrize(
    "sql, expected",
    [
        ("", "no SQL statement"),
        ("  ;  -- nothing here\n", "no SQL statement"),
        ("SELECT 1; DROP TABLE runs", "got 2 statements (SELECT, DROP)"),
        ("SELEC * FROM runs", "syntax error"),
    ],
    ids=["empty", "only_comment", "two_statements", "syntax"],
)
def test_empty_multiple_and_malformed_sql_is_refused(db_path: Path, sql: str, expected: str) -> None:
    before = snapshot(db_path)
    with pytest.raises(StoreError, match="refused") as caught:
        run_readonly_sql(db_path, sql)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)
    assert snapshot(db_path) == before


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT * FROM read_text('/etc/passwd')",
        "SELECT * FROM read_blob('/etc/passwd')",
        "SELECT * FROM glob('/etc/*')",
        "SELECT * FROM read_parquet('/tmp/anything.parquet')",
        "SELECT * FROM '/etc/passwd.csv'",
        "SELECT * FROM read_csv('https://example.com/data.csv')",
    ],
    ids=["read_csv", "read_text", "read_blob", "glob", "read_parquet", "replacement_scan", "http"],
)
def test_file_reading_selects_are_refused_and_fail_in_the_engine(db_path: Path, sql: str) -> None:
    assert check_select_only(sql)  # a SELECT by its statement: the sandbox's inspection refuses it ...
    with pytest.raises(StoreError, match=r"^(refused: table function \w+\(\) is not allowed|query failed: Permission)"):
        run_readonly_sql(db_path, sql)
    # ... and the engine alone, had the inspection missed it, stops it too (defence in depth)
    with connect_readonly(db_path) as connection, pytest.raises(duckdb.Error, match="Permission Error"):
        connection.execute(sql).fetchall()


@pytest.mark.parametrize(
    "sql",
    [
        "SET enable_external_access = true",
        "RESET enable_external_access",
        "SET lock_configuration = false",
        "ATTACH '/tmp/headatlas-other.duckdb' AS other",
        "LOAD httpfs",
    ],
)
def test_engine_refuses_escapes_even_without_the_statement_check(db_path: Path, sql: str) -> None:
    # Defence in depth: a statement the checker missed still meets a locked, confined engine.
    with connect_readonly(db_path) as connection:
        with pytest.raises(duckdb.Error):
            connection.execute(sql)
        assert connection.execute("SELECT current_setting('enable_external_access')").fetchone() == (False,)


# --- limits and failures ------------------------------------------------------------------


def test_time_limit_interrupts_a_long_query(db_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"query stopped after 0.5 s \(time limit\)"):
        run_readonly_sql(db_path, "SELECT count(*) FROM range(10000000000)", timeout_s=0.5)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("timeout_s", [86400.5, 7 * 86400, float("nan"), 0.0, -1.0])
def test_the_time_limit_is_at_most_a_day_for_every_caller(db_path: Path, timeout_s: float) -> None:
    """The API's timeout_s is held to the CLI's range (a day at most): a lake's compaction keeps the
    files a query may read for longer than that, and no longer."""
    with pytest.raises(ParameterError, match=r"more than 0 and at most 86400 \(a day\)"):
        run_readonly_sql(db_path, "SELECT 1", timeout_s=timeout_s)


def test_a_lake_keeps_unneeded_files_longer_than_any_sql_may_read_them() -> None:
    """A file no snapshot needs is deleted FILES_GRACE_S after: past the longest `sql` allowed (its
    time limit, its start and the kill grace), which reads one snapshot throughout."""
    from headatlas.service.config import SQL_TIMEOUT_MAX_S, allowed
    from headatlas.service.storage import confined, readonly
    from headatlas.service.storage.backends.lake_compaction import FILES_GRACE_S

    assert allowed("sql_timeout_s").high == SQL_TIMEOUT_MAX_S
    longest = SQL_TIMEOUT_MAX_S + readonly.SETUP_S + 10.0 + confined.KILL_GRACE_S  # 10 s: the default lock wait
    assert FILES_GRACE_S >= longest


def test_runtime_error_gives_duckdb_first_line(db_path: Path) -> None:
    with pytest.raises(StoreError) as caught:
        run_readonly_sql(db_path, "SELECT * FROM no_such_table")
    message = str(caught.value)
    assert message.startswith("query failed: Catalog Error")
    assert "no_such_table" in message and "\n" not in message


def test_missing_database_names_path_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.duckdb"
    with pytest.raises(StoreError) as caught:
        run_readonly_sql(missing, "SELECT 1")
    message = str(caught.value)
    assert str(missing) in message
    assert "headatlas analyze CORPUS" in message and "HEADATLAS_DB" in message
    assert not missing.exists()


HOLD_WRITE_LOCK = textwrap.dedent(
    """
    import sys, time, duckdb
    connection = duckdb.connect(sys.argv[1])
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
    connection.close()
    """
)


def hold_write_lock(path: Path, seconds: float) -> subprocess.Popen:
    """Start a process that holds the file read-write; return once it has the lock."""
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD_WRITE_LOCK, str(path), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout is not None
    assert writer.stdout.readline().strip() == "locked"
    return writer


def test_lock_held_by_another_process_is_waited_out(db_path: Path) -> None:
    writer = hold_write_lock(db_path, 2.0)
    try:
        started = time.monotonic()
        result = run_readonly_sql(db_path, "SELECT count(*) FROM heads", lock_wait_s=10)
        waited = time.monotonic() - started
    finally:
        writer.wait(timeout=10)
    assert result.rows == [(72,)]
    assert 1.0 < waited < 5.0


def test_lock_held_too_long_gives_busy_error(db_path: Path) -> None:
    writer = hold_write_lock(db_path, 3.0)
    try:
        with pytest.raises(StoreError, match="is busy: another process is writing") as caught:
            run_readonly_sql(db_path, "SELECT 1", lock_wait_s=0.3)
    finally:
        writer.terminate()
        writer.wait(timeout=10)
    assert str(db_path) in str(caught.value) and "retry" in str(caught.value)


def test_retry_on_lock_passes_other_errors_through_at_once() -> None:
    calls = []

    def fails() -> None:
        calls.append(1)
        raise duckdb.InvalidInputException("Cannot change threads - configuration has been locked")

    with pytest.raises(duckdb.InvalidInputException):
        retry_on_lock(fails, wait_s=5)
    assert calls == [1]
