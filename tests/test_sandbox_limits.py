"""The `sql` sandbox's own bounds, as a reader meets them through `headatlas sql`, `run.sql()` and the
web: every refusal is one line and nothing else on stderr (no helper process's traceback), and the
statement's inspection, its memory, its answer's size and its temporary files are bounded wherever
the caller runs.

The CLI's own processes (the console script, its clean helper, the query's process) are real: a
helper's traceback lands on the script's stderr, which no in-process runner captures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import headatlas_cmd, start_cli

from headatlas.service.storage import confined

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(confined.confinement() is not None, reason=str(confined.confinement()))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """A file with the schema."""
    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store

    path = tmp_path_factory.mktemp("limits") / "results.duckdb"
    db.upgrade(Store(path).backend)
    return path


def _script(*args: str, **popen: object) -> subprocess.Popen:
    return start_cli(*args, **popen)


# --- finding: a refused statement printed the helper's traceback ---------------------------------------

# one refusal per stage of the escape table (docs/reliability.md), a caller that fails before its
# helper is ready (a bad option, checked after the helper was started), and the time limit
ONE_LINE = {
    "check": (["DROP TABLE runs"], r"^error: refused: only one SELECT"),
    "inspection": (["SELECT * FROM read_text('/etc/hostname')"], r"^error: refused: table function read_text"),
    "engine": (["SELECT * FROM '/etc/passwd'"], r"^error: query failed: (Permission|Catalog) Error"),
    "bad option": (["SELECT 1", "--memory-limit", "lots"], r"^error: .*--memory-limit 'lots'"),
    "time limit": (
        ["SELECT count(*) FROM range(100000000000000)", "--timeout", "1"],
        r"^error: query stopped after 1 s \(time limit\); narrow it or pass --timeout$",
    ),
}


def test_every_refusal_through_the_console_script_is_one_line(results) -> None:
    """Each runs the real console script, whose helper finds its caller gone or its query's process
    killed: stderr holds the one `error:` line and nothing else (before: the helper's BrokenPipeError
    traceback after every refusal; the time limit's hint read ``--timeout NO_VALUE``)."""
    import re

    for case, (args, _) in ONE_LINE.items():  # one at a time: a loaded machine hides the race
        process = _script("sql", *args, "--db", str(results))
        stdout, stderr = process.communicate(timeout=180)  # also waits for the helper's stderr to close
        assert process.returncode == 2, (case, stdout, stderr)
        assert re.match(ONE_LINE[case][1], stderr), (case, stderr)
        assert stderr.count("\n") == 1 and "Traceback" not in stderr, (case, stderr)


def test_ctrl_c_during_a_query_is_one_line(results) -> None:
    """The terminal's Ctrl-C (SIGINT to the foreground process group) while the query runs: the
    script says so in one line; neither its helper nor the query's process prints anything."""
    process = _script(
        "sql",
        "SELECT count(*) FROM range(100000000000000)",
        "--timeout",
        "120",
        "--db",
        str(results),
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not _grandchildren_of(process.pid) and time.monotonic() < deadline:  # the query's process runs
        time.sleep(0.2)
    assert process.poll() is None
    time.sleep(0.5)
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    time.sleep(1.0)
    assert process.returncode == 130, (stdout, stderr)
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr


def _children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _grandchildren_of(pid: int) -> list[int]:
    return [g for c in _children_of(pid) for g in _children_of(c)]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# --- finding: a deeply nested statement was a RecursionError (a traceback, HTTP 500) ------------------

NESTED = {
    "900 terms": "SELECT " + "+".join(["1"] * 900),
    "900-deep lists": "SELECT " + "[" * 900 + "1" + "]" * 900,
    "900-deep abs": "SELECT " + "abs(" * 900 + "1" + ")" * 900,
    "400-deep CASE": "SELECT " + "CASE WHEN true THEN " * 400 + "1" + " END" * 400,
    "1200-deep subqueries": "SELECT " + "(SELECT " * 1200 + "1" + ")" * 1200,
}


@pytest.mark.parametrize("sql", NESTED.values(), ids=NESTED.keys())
def test_a_deeply_nested_statement_is_refused_in_one_line(results, cli, sql) -> None:
    done = cli("sql", sql, "--db", str(results))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: refused: SELECT is nested too deeply to inspect"), done.stderr
    assert done.stderr.rstrip().endswith("simplify it") and done.stderr.count("\n") == 1, done.stderr


# --- finding: the statement's inspection ran in the caller, unbounded (2,000 CTEs: 3.66 GB, 59 s) -------

CTES = "WITH " + ",".join(f"a{i} AS(SELECT 1)" for i in range(2000)) + " SELECT 1"  # 45 KB


def test_a_statement_costly_to_inspect_is_refused_in_the_query_process(results) -> None:
    """The parse is quadratic in CTEs: the inspection runs in the query's process, under bounds of
    its own (CHECK_S, CHECK_BYTES), and this process (the web server, the CLI) does not grow."""
    import resource

    from headatlas.service.errors import StoreError
    from headatlas.service.storage.readonly import CHECK_BYTES, run_readonly_sql

    run_readonly_sql(results, "SELECT 1")  # the helper started, the names known: what grows now is the check
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    began = time.monotonic()
    with pytest.raises(StoreError, match=r"^refused: .*simplify it") as caught:
        run_readonly_sql(results, CTES, timeout_s=120)
    took = time.monotonic() - began
    assert "\n" not in str(caught.value)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grown < 100 * 2**20, grown  # before: 3.4 GB in this process
    peak = confined.last_peak_bytes()
    assert peak is not None and peak < CHECK_BYTES + 512 * 2**20, peak  # the query's process, bounded
    assert took < 45, took  # before: 35-59 s; a generous bound (the check's own is 10 s)


def test_a_statement_longer_than_anyone_types_is_refused_before_a_process_starts(results, cli) -> None:
    done = cli("sql", "SELECT 1" + " " * 200_000, "--db", str(results))
    assert done.returncode == 2
    assert done.stderr.startswith("error: refused: the statement is 200,008 characters long"), done.stderr
    assert done.stderr.count("\n") == 1


# --- finding: under a hard address-space limit (ulimit -v) every query failed ---------------------------


@pytest.mark.parametrize("memory", [[], ["--memory-limit", "16GB"]], ids=["default", "more than the limit"])
def test_sql_runs_under_a_hard_address_space_limit(results, memory) -> None:
    """A shell's ``ulimit -v 8388608`` (8 GiB, soft and hard): the query's process caps itself under
    it instead of failing to raise it (before: "exit code 4 … pass --memory-limit", whatever it was)."""
    command = " ".join([*headatlas_cmd(), "sql", "'SELECT 42 AS answer'", "--db", str(results), *memory])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        ["bash", "-c", f"ulimit -v 8388608 && exec {command}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "42" in done.stdout and not done.stderr


# --- finding: a query killed at its limit left its spill folder or catalogue copy in /tmp ---------------

STOPPED = {
    # string_split builds its list without checking for an interrupt: killed at the time limit
    "time limit": ("SELECT len(string_split(repeat('a,', 100000000), ','))", {"timeout_s": 1.0}, "time limit"),
    "memory limit": ("SELECT length(repeat('x', 4000000000))", {"memory_limit": "512MB"}, "memory than its limit"),
}


@pytest.mark.parametrize("backend", ["file", "lake"])
@pytest.mark.parametrize("case", STOPPED, ids=STOPPED)
def test_a_query_stopped_at_its_limit_leaves_nothing_in_the_temporary_folder(
    request, results, tmp_path, monkeypatch, backend, case
) -> None:
    """Before: the spill folder (a file) or the catalogue's copy (a lake, 3.9 MB) stayed in /tmp
    after every query killed at its time limit."""
    import tempfile

    from headatlas.service.errors import StoreError
    from headatlas.service.storage.readonly import run_readonly_sql

    where = results if backend == "file" else request.getfixturevalue("lake").backend()
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    sql, limits, said = STOPPED[case]
    with pytest.raises(StoreError, match=said):
        run_readonly_sql(where, sql, **{"timeout_s": 30.0, **limits})  # type: ignore[arg-type]
    assert not list(temporary.iterdir())
    assert run_readonly_sql(where, "SELECT 1").rows == [(1,)]  # and one that answers: nothing either
    assert not list(temporary.iterdir())


# --- finding: values built outside DuckDB's buffer manager grew to 3-4 GB before the time limit ------------

OUTSIDE = {
    "format": "SELECT length(format('{:>2000000000}', 'x'))",
    "printf": "SELECT length(printf('%2000000000d', 1))",
    "string_split": "SELECT len(string_split(repeat('a,', 300000000), ','))",
}


@pytest.mark.parametrize("sql", OUTSIDE.values(), ids=OUTSIDE.keys())
def test_a_value_past_the_memory_limit_stops_the_query_in_one_line(results, sql) -> None:
    from headatlas.service.errors import StoreError
    from headatlas.service.storage.readonly import run_readonly_sql

    with pytest.raises(StoreError, match=r"^query stopped: it needs more memory than its limit") as caught:
        run_readonly_sql(results, sql, memory_limit="512MB", timeout_s=120)
    assert "\n" not in str(caught.value)
    peak = confined.last_peak_bytes()
    assert peak is not None and peak < 512 * 2**20 + 768 * 2**20, peak  # the limit, the margins, the helper's pages


def test_the_default_memory_limit_stops_a_2_gb_value(results) -> None:
    """The default was a quarter of the machine (6 GB of 24): format's 2 GB string ran 3 GB into the
    query's process until the time limit. A quarter at most 2 GiB stops it."""
    from headatlas.service.errors import StoreError
    from headatlas.service.storage.readonly import _bytes, default_memory_limit, run_readonly_sql

    assert _bytes(default_memory_limit()) <= 2 * 2**30
    with pytest.raises(StoreError, match=r"^query stopped: it needs more memory than its limit"):
        run_readonly_sql(results, OUTSIDE["format"], timeout_s=120)


# --- finding: an answer had no cap on its bytes (1,000 rows of 500 KB: 500 MB to the web) ---------------

WIDE = "SELECT repeat('x', 500000) || range AS s FROM range(1000)"


def test_a_statement_runs_on_the_threads_the_setting_allows(results, monkeypatch) -> None:
    """HEADATLAS_SQL_THREADS: the threads one statement's DuckDB may use (a server runs two at
    once); by default as many as the machine has cores; a value out of range is refused naming it.
    (The sandbox refuses current_setting(): the query's own settings are read where it is made.)"""
    from headatlas.service.errors import HeadatlasError
    from headatlas.service.storage import readonly

    made: list[int] = []
    real = readonly.run_confined

    def confined(query, **limits):
        made.append(query.threads)
        assert limits["threads"] == query.threads
        return real(query, **limits)

    monkeypatch.setattr(readonly, "run_confined", confined)
    monkeypatch.delenv("HEADATLAS_SQL_THREADS", raising=False)
    assert readonly.run_readonly_sql(results, "SELECT 42 AS n").rows == [(42,)]
    monkeypatch.setenv("HEADATLAS_SQL_THREADS", "1")
    assert readonly.run_readonly_sql(results, "SELECT 42 AS n").rows == [(42,)]
    assert made == [os.cpu_count(), 1]
    monkeypatch.setenv("HEADATLAS_SQL_THREADS", "-1")
    with pytest.raises(HeadatlasError, match="HEADATLAS_SQL_THREADS='-1'"):
        readonly.run_readonly_sql(results, "SELECT 42 AS n")


def test_an_answer_past_its_byte_cap_stops_the_query_in_one_line(results, cli, monkeypatch) -> None:
    """64 MiB by default, for every front end (run_readonly_sql's ``max_bytes``): the query's
    process stops fetching there, and this process never holds the answer. A 500 MB answer within
    its cap comes back, on one thread too (pickled whole beside its rows, under the 2 GiB memory
    limit's address-space cap, it failed so in about half the tries)."""
    import resource

    from headatlas.service.errors import StoreError
    from headatlas.service.storage.readonly import run_readonly_sql

    run_readonly_sql(results, "SELECT 1")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    with pytest.raises(StoreError, match=r"^query stopped: its answer passed 64 MiB .* after \d+ rows") as caught:
        run_readonly_sql(results, WIDE)
    assert "\n" not in str(caught.value)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before < 200 * 2**20
    assert len(run_readonly_sql(results, WIDE, max_bytes="1GB").rows) == 1000
    monkeypatch.setenv("HEADATLAS_SQL_THREADS", "1")
    assert len(run_readonly_sql(results, WIDE, max_bytes="1GB").rows) == 1000
    monkeypatch.delenv("HEADATLAS_SQL_THREADS")
    small = run_readonly_sql(results, "SELECT range FROM range(10)", max_bytes=1000)
    assert len(small.rows) == 10
    done = cli("sql", WIDE, "--db", str(results), "--max-bytes", "1MB")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("error: query stopped: its answer passed 1 MB"), done.stderr
    assert done.stderr.rstrip().endswith("add LIMIT, select fewer or shorter columns, or pass --max-bytes")
    assert cli("sql", "SELECT 1", "--db", str(results), "--max-bytes", "lots").returncode == 2


# --- finding: a lake's sql showed its storage (data files' paths, the data path) ------------------------

STORAGE = {
    "list_files": "SELECT * FROM ducklake_list_files('lake', 'runs')",
    "options": "SELECT * FROM ducklake_options('lake')",
    "table_info": "SELECT * FROM ducklake_table_info('lake')",
}


@pytest.mark.parametrize("sql", STORAGE.values(), ids=STORAGE.keys())
def test_the_lake_storage_listings_are_refused_in_the_same_words_as_on_a_file(results, lake, sql) -> None:
    """How the lake is stored is not a result: refused on a lake (before: every data file's absolute
    path and the data path), as on a file, which has no such function, in the same words."""
    from headatlas.service.errors import StoreError
    from headatlas.service.storage.readonly import run_readonly_sql

    said = []
    for where in (results, lake.backend()):
        with pytest.raises(StoreError, match=r"^refused: table function ducklake_\w+\(\) is not allowed") as caught:
            run_readonly_sql(where, sql)
        said.append(str(caught.value))
    assert said[0] == said[1]


def test_the_lake_history_stays_readable_and_shows_no_path(lake) -> None:
    from headatlas.service.storage.readonly import run_readonly_sql

    backend = lake.backend()
    data = str(lake.data_path)
    for sql in (
        "SELECT * FROM ducklake_snapshots('lake')",
        "SELECT * FROM ducklake_current_snapshot('lake')",
        "SELECT * FROM ducklake_table_changes('lake', 'main', 'runs', 0, 1)",
    ):
        shown = run_readonly_sql(backend, sql)
        assert data not in str(shown.rows) and ".parquet" not in str(shown.rows), (sql, shown.rows)
