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
from conftest import headatlas_cmd

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
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen(
        [*headatlas_cmd(), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
        **popen,  # type: ignore[arg-type]
    )


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
