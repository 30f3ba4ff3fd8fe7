"""The `sql` sandbox's escape table (docs/reliability.md), run against a file and a lake: every
row is refused, by the stage the table names, and neither database changes; and the confined
process that holds the memory and time limits for values DuckDB builds outside its buffer manager."""

from __future__ import annotations

import hashlib
import re
import resource
import time
from pathlib import Path

import pytest

from headatlas.service.errors import StoreError
from headatlas.service.storage import confined
from headatlas.service.storage.readonly import run_readonly_sql

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## The `sql` sandbox: escapes tried, file and lake"
ROW = re.compile(r"^\| (?P<name>[^|]+?) \| `(?P<sql>[^`]+)` \| (?P<file>\w+) \| (?P<lake>\w+) \|$")
STAGES = {
    "check": r"^refused: only one SELECT",
    "inspection": r"^refused: (?!only one SELECT)",
    "engine": r"^query failed: (Permission|Catalog|Binder) Error",
}


def escape_table() -> list[tuple[str, str, str, str]]:
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            sql = match["sql"].replace("\\r", "\r")
            rows.append((match["name"], sql, match["file"], match["lake"]))
    return rows


CASES = escape_table()


def test_the_table_holds_the_known_escapes() -> None:
    sql = "\n".join(case[1] for case in CASES)
    for needle in (
        "query('SELECT * FROM postgres_query",
        "pg_read_file",
        "lo_from_bytea",
        "pg_terminate_backend",
        "query_table('__ducklake_metadata",
        "duckdb_databases()",
        "SHOW DATABASES",
        "PRAGMA database_list",
        "\rIMPORT",
        "; IMPORT",
        ".tmp/",
        "json_execute_serialized_sql",
        "read_csv",
    ):
        assert needle in sql, needle
    assert len(CASES) >= 40
    assert {stage for case in CASES for stage in case[2:]} <= set(STAGES)


@pytest.fixture(scope="module")
def targets(tmp_path_factory, lake_template):
    """A file and a lake, each with the schema, and what each holds before any escape is tried."""
    import lake_support

    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store

    folder = tmp_path_factory.mktemp("escapes")
    path = folder / "results.duckdb"
    db.upgrade(Store(path).backend)
    lake = lake_support.new_lake(folder, template=lake_template)
    yield {"file": path, "lake": lake}
    lake_support.remove_lake(lake)


def _state(target) -> object:
    """What could change: the file's bytes; the lake's snapshots and the catalogue server's large
    objects and sessions of this catalogue."""
    if isinstance(target, Path):
        return hashlib.sha256(target.read_bytes()).hexdigest()
    import lake_support

    out = lake_support._psql(
        "SELECT (SELECT count(*) FROM pg_largeobject_metadata), (SELECT max(snapshot_id) FROM ducklake_snapshot)",
        dbname=target.name,
    )
    return out.stdout.strip()


@pytest.mark.parametrize("backend", ["file", "lake"])
@pytest.mark.parametrize(("name", "sql", "file_stage", "lake_stage"), CASES, ids=[c[0] for c in CASES])
def test_every_escape_is_refused(targets, backend, name, sql, file_stage, lake_stage) -> None:
    target = targets[backend]
    where = target if backend == "file" else target.backend()
    before = _state(target)
    with pytest.raises(StoreError) as caught:
        run_readonly_sql(where, sql, timeout_s=30)
    message = str(caught.value)
    stage = file_stage if backend == "file" else lake_stage
    assert re.match(STAGES[stage], message), (stage, message)
    assert "\n" not in message
    assert _state(target) == before


def test_the_results_stay_readable_in_the_sandbox(targets) -> None:
    # the allow-list is not a refusal of everything: listings, DESCRIBE, SUMMARIZE and generators run
    readable = [
        "DESCRIBE head_metrics",
        "SUMMARIZE runs",
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'runs'",
        "SELECT sum(range) FROM range(4)",
        "SELECT pg_typeof(1)",
        "SELECT TIMESTAMPTZ '2026-12-02 10:00:00+00' AS at",  # needs pytz, which DuckDB imports for it
    ]
    for sql in readable:
        assert run_readonly_sql(targets["file"], sql).rows, sql
    lake = targets["lake"].backend()  # each query attaches the catalogue: three, not all
    for sql in [*readable[::2], "SELECT count(*) FROM ducklake_snapshots('lake')"]:
        assert run_readonly_sql(lake, sql).rows, sql


# --- the confined process --------------------------------------------------------------------


def test_a_query_that_ignores_its_interrupt_is_killed_at_the_deadline() -> None:
    if confined.confinement():
        pytest.skip(confined.confinement())

    def stuck(started) -> None:
        started()
        time.sleep(60)  # nothing here checks for an interrupt

    began = time.monotonic()
    with pytest.raises(confined.ChildFailed) as caught:
        confined.run_confined(stuck, memory_bytes=None, threads=1, timeout_s=0.5, setup_s=10)
    took = time.monotonic() - began
    assert caught.value.timed_out
    assert 0.5 + confined.KILL_GRACE_S <= took < 0.5 + confined.KILL_GRACE_S + 2.0


def test_the_child_cannot_grow_past_its_memory_cap() -> None:
    if confined.confinement():
        pytest.skip(confined.confinement())

    def greedy(started) -> int:
        started()
        return len(bytearray(2 * 2**30))  # 2 GB against a 64 MB limit (plus the margins)

    with pytest.raises(MemoryError):
        confined.run_confined(greedy, memory_bytes=64 * 2**20, threads=1, timeout_s=30, setup_s=10)
    # and the cap is the child's alone
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY


@pytest.mark.parametrize(
    "sql", ["SELECT len(range(0, 400000000))", "SELECT length(repeat('x', 4000000000))"], ids=["list", "string"]
)
def test_values_built_outside_the_buffer_manager_stop_at_the_memory_limit(targets, sql) -> None:
    began = time.monotonic()
    with pytest.raises(StoreError, match=r"^query stopped: it needs more memory than its limit") as caught:
        run_readonly_sql(targets["file"], sql, memory_limit="1GB", timeout_s=60)
    assert "--memory-limit" in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - began < 30  # before: 84-165 s, then the kernel's OOM killer


def test_a_reader_role_reads_the_lake_and_nothing_else(targets) -> None:
    """docs/distributed.md's reader role: `sql` works under it, and even the sandbox's own connection
    (past the inspection) can neither read a file of the server nor write the catalogue."""
    import duckdb
    import lake_support

    from headatlas.service.storage.backends.lake import LakeBackend
    from headatlas.service.storage.readonly import connect_readonly

    lake = targets["lake"]
    role = f"{lake.name}_reader"
    grants = (
        f"CREATE ROLE {role} LOGIN; GRANT CONNECT ON DATABASE {lake.name} TO {role}; "
        f"GRANT USAGE ON SCHEMA public TO {role}; GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}; "
        "REVOKE EXECUTE ON FUNCTION lo_from_bytea(oid, bytea), lo_create(oid), lo_creat(integer) FROM PUBLIC"
    )
    assert lake_support._psql(grants, dbname=lake.name).returncode == 0
    try:
        reader = LakeBackend(f"{lake.url} user={role}", data_path=lake.data_path)
        assert run_readonly_sql(reader, "SELECT count(*) FROM runs").rows == [(0,)]
        with connect_readonly(reader) as connection:
            for sql in (
                "SELECT pg_read_file('/etc/hostname')",
                "SELECT lo_from_bytea(0, 'x'::bytea)",
                "INSERT INTO ducklake_snapshot SELECT * FROM ducklake_snapshot LIMIT 0",
            ):
                quoted = sql.replace("'", "''")
                with pytest.raises(duckdb.Error, match="permission denied|read-only transaction"):
                    connection.execute(f"CALL postgres_execute('__ducklake_metadata_lake', '{quoted}')")
    finally:
        lake_support._psql(f"DROP OWNED BY {role}; DROP ROLE {role}", dbname=lake.name)
