"""What every storage backend does, run against every backend: the embedded file, the lake
(DuckLake on PostgreSQL; skipped where none runs) and the tests' plugin's in-memory DuckDB
(``memduck:``, from tests/plugins/, found through the headatlas.backends entry point).

- a transaction commits whole or not at all;
- what one process commits another sees, for a backend that says it is shared between processes
  (``between_processes``), and never for one that says it is not;
- keys, or their emulation (a lake's deterministic ids checked in the committing transaction):
  a batch delivered twice is counted once, a window under two batch ids is refused whole;
- the `sql` sandbox: a backend that says it confines user SQL (``confines_sql``) refuses every row
  of the escape table of docs/reliability.md (the table tests/test_sandbox_escapes.py reads), at
  the stage its column names; `sql` refuses a backend that does not say so, in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import pytest
from sqlalchemy import text

from headatlas.service.errors import StoreError
from headatlas.service.storage import db
from headatlas.service.storage.backends import open_backend
from headatlas.service.storage.readonly import run_readonly_sql
from headatlas.service.storage.store import Store

BACKENDS = ["file", "lake", "memduck"]


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path):
    """A new, empty database of each backend, with its URL as another process would name it."""
    if request.param == "file":
        return open_backend(str(tmp_path / "c.duckdb"))
    if request.param == "lake":
        lake = request.getfixturevalue("lake")
        return lake.backend()
    return open_backend(f"memduck:{uuid.uuid4().hex}")


def _table(backend, name: str = "t") -> None:
    with backend.transaction() as conn:
        conn.execute(text(f"CREATE TABLE {name} (k INTEGER, v VARCHAR)"))


def _rows(backend, name: str = "t") -> list[tuple]:
    with backend.transaction(read_only=True) as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT k, v FROM {name} ORDER BY k"))]


def test_the_plugin_backend_comes_from_its_entry_point():
    memory = open_backend("memduck:x")
    assert type(memory).__module__ == "headatlas_test_plugins.memory"
    assert memory.origin == "plugin memduck (headatlas-test-plugins 0.1.0)"
    assert (memory.confines_sql, memory.between_processes) == (False, False)


def test_a_transaction_commits_whole_or_not_at_all(backend):
    _table(backend)
    with backend.transaction() as conn:
        conn.execute(text("INSERT INTO t VALUES (1, 'kept'), (2, 'kept')"))
    with pytest.raises(RuntimeError), backend.transaction() as conn:
        conn.execute(text("INSERT INTO t VALUES (3, 'lost')"))
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 3  # its own write, before the end
        raise RuntimeError("the unit of work failed")
    assert _rows(backend) == [(1, "kept"), (2, "kept")]


CHILD = """
import json, sys
from sqlalchemy import text
from headatlas.service.storage.backends import open_backend
backend = open_backend(sys.argv[1])
try:
    with backend.transaction(read_only=True) as conn:
        seen = [list(r) for r in conn.execute(text("SELECT k, v FROM t ORDER BY k"))]
except Exception as exc:
    seen = type(exc).__name__
if isinstance(seen, list):
    with backend.transaction() as conn:
        conn.execute(text("INSERT INTO t VALUES (10, 'from the child')"))
print(json.dumps(seen))
"""


def test_another_process_sees_the_commits_of_a_shared_backend_and_only_of_one(backend):
    _table(backend)
    with backend.transaction() as conn:
        conn.execute(text("INSERT INTO t VALUES (1, 'from the parent')"))
    child = subprocess.run(
        [sys.executable, "-c", CHILD, backend.url], capture_output=True, text=True, timeout=300, check=False
    )
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.strip().splitlines()[-1])
    if backend.between_processes:
        assert seen == [[1, "from the parent"]]
        assert _rows(backend) == [(1, "from the parent"), (10, "from the child")]
    else:  # its database lives in this process: the child's is another, without the table
        assert seen != [[1, "from the parent"]]
        assert _rows(backend) == [(1, "from the parent")]


def test_keys_or_their_emulation_count_a_batch_once(backend, tiny_model, small_corpus):
    """The store's invariants hold on every backend: a redelivered batch is skipped, a window
    counted under another batch id is refused with nothing written."""
    from test_store import SMALL, _results, _run

    db.upgrade(backend)
    store = Store(backend)
    run = _run(store, tiny_model, small_corpus)
    results = _results(tiny_model, small_corpus, params=SMALL)

    def count(table: str) -> int:
        # a lake reserves a batch in a transaction of its own before storing it (docs/architecture.md,
        # "Exactly once on a lake"): a reservation is not a stored batch
        done = " AND status = 'done'" if table == "batches" else ""
        with backend.transaction(read_only=True) as conn:
            query = f"SELECT count(*) FROM {table} WHERE run_id = {run.run_id}{done}"
            return int(conn.execute(text(query)).scalar())

    assert store.ingest(run.run_id, [(0, results[0]), (1, results[1])]) == 2
    windows, stored = count("run_windows"), count("batches")
    assert stored == 2
    assert store.ingest(run.run_id, [(0, results[0])]) == 0  # redelivered: skipped
    assert store.ingest(run.run_id, [(1, results[1]), (2, results[2])]) == 1
    assert count("run_windows") == windows + len(results[2].window_ids)
    before = {t: count(t) for t in ("batches", "run_windows", "head_stats")}
    with pytest.raises(StoreError, match="already counted"):
        store.ingest(run.run_id, [(7, results[0])])
    assert {t: count(t) for t in before} == before  # nothing half-written


def _escape_cases():
    from test_sandbox_escapes import CASES, SECTION, STAGES

    return CASES, SECTION, STAGES


def test_sql_confines_a_backend_that_says_so_and_refuses_one_that_does_not(backend):
    db.upgrade(backend)
    cases, section, stages = _escape_cases()
    if not backend.confines_sql:
        with pytest.raises(StoreError) as caught:
            run_readonly_sql(backend, "SELECT count(*) FROM runs")
        message = str(caught.value)
        assert "\n" not in message and message.startswith(f"--db {backend.label}: the {backend.kind} backend")
        assert "cannot confine the sql sandbox" in message and backend.origin in message
        return
    header = re.search(r"^\| escape \| SQL \| (.*) \|$", _table_header(section), re.M)
    assert header is not None
    columns = [c.strip() for c in header.group(1).split("|")]
    assert backend.kind in columns, f"the escape table has no column for the {backend.kind} backend"
    column = columns.index(backend.kind)
    assert run_readonly_sql(backend, "SELECT count(*) FROM runs").rows == [(0,)]
    before = _state(backend)
    for name, sql, *expected in cases:
        if stages[expected[column]] is None:  # not an escape on this backend: it runs, showing no catalogue
            assert "__ducklake" not in str(run_readonly_sql(backend, sql, timeout_s=30).rows), name
            continue
        with pytest.raises(StoreError) as caught:
            run_readonly_sql(backend, sql, timeout_s=30)
        message = str(caught.value)
        assert re.match(stages[expected[column]], message) and "\n" not in message, (name, message)
    assert _state(backend) == before


def _state(backend) -> object:
    """What an escape could change: a file's bytes; a lake's last snapshot."""
    import hashlib

    path = getattr(backend, "path", None)
    if path is not None:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    with backend.transaction(read_only=True) as conn:
        return backend.snapshot_of(conn)


def _table_header(section: str) -> str:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    return doc.split(section, 1)[1].split("\n## ", 1)[0]
