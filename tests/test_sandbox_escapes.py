"""The `sql` sandbox's escape table (docs/reliability.md), run against a file and a lake: every
escape is refused, by the stage the table names, and neither database changes; what the lake's
sandbox instance can reach with the inspection out of the way (nothing of the catalogue's server);
the catalogue roles docs/distributed.md recommends; and the confined process that holds the memory
and time limits, started safely from a process that runs other threads.

The file's rows and the confined process need no PostgreSQL: only the lake's rows skip without it."""

from __future__ import annotations

import hashlib
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import confined_support
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
    "results": None,  # not refused: it runs, and what it shows holds nothing of a catalogue
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
def file_target(tmp_path_factory) -> Path:
    """A file with the schema."""
    from headatlas.service.storage import db
    from headatlas.service.storage.store import Store

    path = tmp_path_factory.mktemp("escapes") / "results.duckdb"
    db.upgrade(Store(path).backend)
    return path


@pytest.fixture(scope="module")
def lake_target(tmp_path_factory, lake_template):
    """A lake with the schema (skips without PostgreSQL)."""
    import lake_support

    lake = lake_support.new_lake(tmp_path_factory.mktemp("escapes-lake"), template=lake_template)
    yield lake
    lake_support.remove_lake(lake)


def _state(target) -> object:
    """What could change: the file's bytes; the lake's snapshots and the catalogue server's large
    objects."""
    if isinstance(target, Path):
        return hashlib.sha256(target.read_bytes()).hexdigest()
    import lake_support

    out = lake_support._psql(
        "SELECT (SELECT count(*) FROM pg_largeobject_metadata), (SELECT max(snapshot_id) FROM ducklake_snapshot)",
        dbname=target.name,
    )
    return out.stdout.strip()


def _target(request, backend: str):
    return request.getfixturevalue("file_target" if backend == "file" else "lake_target")


@pytest.mark.parametrize("backend", ["file", "lake"])
@pytest.mark.parametrize(("name", "sql", "file_stage", "lake_stage"), CASES, ids=[c[0] for c in CASES])
def test_every_escape_is_refused(request, backend, name, sql, file_stage, lake_stage) -> None:
    target = _target(request, backend)
    where = target if backend == "file" else target.backend()
    before = _state(target)
    stage = file_stage if backend == "file" else lake_stage
    if STAGES[stage] is None:
        shown = run_readonly_sql(where, sql, timeout_s=30)
        assert shown.rows and "__ducklake" not in str(shown.rows)
    else:
        with pytest.raises(StoreError) as caught:
            run_readonly_sql(where, sql, timeout_s=30)
        message = str(caught.value)
        assert re.match(STAGES[stage], message), (stage, message)
        assert "\n" not in message
    assert _state(target) == before


def test_no_results_table_is_named_like_a_system_view_or_table_function(file_target) -> None:
    """The inspection refuses a table named like one of DuckDB's system views or table functions
    whatever its qualifiers (``main.duckdb_databases`` reaches the view): that must never hide a
    results table or view."""
    import duckdb

    from headatlas.service.storage.sql_check import table_function_names

    with duckdb.connect(str(file_target), read_only=True) as connection:
        names = {
            n
            for (n,) in connection.execute(
                "SELECT table_name FROM duckdb_tables() UNION SELECT view_name FROM duckdb_views() WHERE NOT internal"
            ).fetchall()
        }
    assert len(names) > 20 and "runs" in names
    from headatlas.service.storage.sql_check import system_view_names

    assert not names & (system_view_names() | table_function_names())
    counts = " UNION ALL ".join(f'SELECT count(*) FROM main."{name}"' for name in sorted(names))
    assert len(run_readonly_sql(file_target, counts).rows) == len(names)  # each one passes the inspection


def test_the_results_stay_readable_in_the_sandbox(request, file_target) -> None:
    # the allow-list is not a refusal of everything: listings, DESCRIBE, SUMMARIZE and generators run
    readable = [
        "DESCRIBE head_metrics",
        "SUMMARIZE runs",
        "SHOW TABLES",
        "SELECT sum(range) FROM range(4)",
        "SELECT pg_typeof(1)",
        "SELECT TIMESTAMPTZ '2026-12-02 10:00:00+00' AS at",  # needs pytz, which DuckDB imports for it
        "SELECT name FROM pragma_table_info('runs')",
    ]
    for sql in [*readable, "SELECT count(*) FROM duckdb_tables() WHERE table_name = 'runs'"]:
        assert run_readonly_sql(file_target, sql).rows, sql
    lake = request.getfixturevalue("lake_target").backend()  # each query copies the catalogue: some, not all
    for sql in [*readable[::2], "SELECT count(*) FROM ducklake_snapshots('lake')"]:
        assert run_readonly_sql(lake, sql).rows, sql
    tables = {n for (n,) in run_readonly_sql(lake, "SHOW TABLES").rows}
    assert "runs" in tables and not any(t.startswith("ducklake_") for t in tables)


# what the escapes would run with the inspection out of the way: in the lake's sandbox
# instance, each must find nothing to run it with (the PostgreSQL extension is not loaded there)
PAST_THE_INSPECTION = [
    "SELECT * FROM postgres_query('__ducklake_metadata_lake', 'SELECT pg_read_file(''/etc/passwd'')')",
    "CALL postgres_execute('__ducklake_metadata_lake', 'SELECT lo_export(lo_from_bytea(0, ''x''), ''/tmp/x'')')",
    "SELECT * FROM postgres_query('__ducklake_metadata_lake', 'SELECT pg_terminate_backend(pid) FROM pg_stat_activity')",
    "SELECT * FROM postgres_scan('{conninfo}', 'pg_catalog', 'pg_stat_activity')",
    "SELECT * FROM query('SELECT * FROM postgres_query(''__ducklake_metadata_lake'', ''SELECT 1'')')",
    "SELECT pg_terminate_backend(1)",
    "LOAD postgres_scanner",
    "INSTALL postgres_scanner",
    "ATTACH '{conninfo}' AS server (TYPE postgres)",
    "ATTACH 'ducklake:postgres:{conninfo}' AS again",
    "SET enable_external_access = true",
    "SET lock_configuration = false",
]


def test_the_lake_sandbox_has_no_way_to_the_catalogue_server(lake_target) -> None:
    """With the inspection out of the way (the sandbox's own connection), nothing reaches the
    catalogue's PostgreSQL: no function of the extension exists there, it cannot be loaded, nothing
    can be attached, and the server holds no session of it. The catalogue's tables are a private
    copy (query_table reads it: the inspection refuses that, the engine alone would not)."""
    import duckdb
    import lake_support

    from headatlas.service.storage.readonly import connect_readonly

    backend = lake_target.backend()
    lake_target.release()  # this process holds no session of the catalogue before the sandbox opens
    conninfo = backend.conninfo.replace("'", "''")
    with connect_readonly(backend) as connection:
        sessions = lake_support._psql(
            f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{lake_target.name}' AND pid <> pg_backend_pid()"
        )
        assert sessions.stdout.strip() == "0", sessions
        for sql in PAST_THE_INSPECTION:
            with pytest.raises(duckdb.Error, match=r"^(Catalog|Permission|Invalid Input) Error") as caught:
                connection.execute(sql.format(conninfo=conninfo))
            assert (
                "postgres"
                not in connection.execute("SELECT string_agg(type, ' ') FROM duckdb_databases()").fetchone()[0]
            ), caught
        databases = connection.execute("SELECT database_name, type, path FROM duckdb_databases()").fetchall()
        assert {name for name, _type, _path in databases} <= {
            "lake",
            "__ducklake_metadata_lake",
            "memory",
            "system",
            "temp",
        }
        assert not any("dbname" in str(path) or "host=" in str(path) for _n, _t, path in databases)
        copy = connection.execute("SELECT count(*) FROM query_table('__ducklake_metadata_lake.ducklake_snapshot')")
        assert copy.fetchone()[0] >= 1


@pytest.mark.parametrize("backend", ["file", "lake"])
def test_extension_signatures_are_checked_where_a_readers_sql_runs(request, backend) -> None:
    """headatlas's own instances load the wheels' extensions without DuckDB's signature check (a
    SHA-256 of 50 MB a load, duckdb_settings.OWN_EXTENSIONS); the sandbox's instance, where a reader's
    SQL runs, checks it, with external access off and its configuration locked."""
    from sqlalchemy import text

    from headatlas.service.storage.backends import open_backend
    from headatlas.service.storage.readonly import connect_readonly

    target = _target(request, backend)
    where = open_backend(target) if backend == "file" else target.backend()
    query = (
        "SELECT name, value FROM duckdb_settings() WHERE name IN "
        "('allow_unsigned_extensions', 'enable_external_access', 'lock_configuration')"
    )
    with connect_readonly(where) as connection:
        sandbox = dict(connection.execute(query).fetchall())
    with where.transaction(read_only=True) as conn:
        own = dict(conn.execute(text(query)).all())
    assert sandbox == {
        "allow_unsigned_extensions": "false",
        "enable_external_access": "false",
        "lock_configuration": "true",
    }
    assert own == {"allow_unsigned_extensions": "true", "enable_external_access": "true", "lock_configuration": "false"}


# --- the confined process --------------------------------------------------------------------


def test_a_query_that_ignores_its_interrupt_is_killed_at_the_deadline() -> None:
    if confined.confinement():
        pytest.skip(confined.confinement())
    began = time.monotonic()
    with pytest.raises(confined.ChildFailed) as caught:
        confined.run_confined(confined_support.stuck, memory_bytes=None, threads=1, timeout_s=0.5, setup_s=30)
    took = time.monotonic() - began
    assert caught.value.timed_out
    assert 0.5 + confined.KILL_GRACE_S <= took < 0.5 + confined.KILL_GRACE_S + 2.0 + _helper_start()


def _helper_start() -> float:
    """The first call from this process may start the clean helper (a fresh interpreter): allowed for."""
    return 0.0 if confined._ZYGOTE is not None and confined._ZYGOTE.alive() else 15.0


def test_the_child_cannot_grow_past_its_memory_cap() -> None:
    if confined.confinement():
        pytest.skip(confined.confinement())
    with pytest.raises(MemoryError):
        confined.run_confined(confined_support.greedy, memory_bytes=64 * 2**20, threads=1, timeout_s=30, setup_s=30)
    # and the cap is the child's alone
    assert resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY


@pytest.mark.parametrize(
    "sql", ["SELECT len(range(0, 400000000))", "SELECT length(repeat('x', 4000000000))"], ids=["list", "string"]
)
def test_values_built_outside_the_buffer_manager_stop_at_the_memory_limit(file_target, sql) -> None:
    began = time.monotonic()
    with pytest.raises(StoreError, match=r"^query stopped: it needs more memory than its limit") as caught:
        run_readonly_sql(file_target, sql, memory_limit="1GB", timeout_s=60)
    assert "--memory-limit" in str(caught.value) and "\n" not in str(caught.value)
    assert time.monotonic() - began < 30  # before: 84-165 s, then the kernel's OOM killer
    peak = confined.last_peak_bytes()
    assert peak is not None and 0 < peak < 10**9  # the query's process stayed under its 1 GB (before: 17 GB)


def test_a_process_with_other_threads_starts_its_query_from_a_clean_helper(monkeypatch) -> None:
    """A child forked from a process that runs other threads inherits their locks held and their
    state: the query's process must come from the clean helper then. Here a thread of this process
    holds a lock while the child starts, and this process has changed a module's state: the child
    takes the lock at once and sees the state as imported (forked, it would wait on the lock for
    ever and see the change)."""
    if confined.confinement():
        pytest.skip(confined.confinement())
    monkeypatch.setattr(confined_support, "STATE", "changed by the caller")
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with confined_support.HELD:
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(10) and confined.threads_now() > 1
        state, took = confined.run_confined(
            confined_support.inherited, memory_bytes=None, threads=1, timeout_s=30, setup_s=30
        )
    finally:
        release.set()
        holder.join(10)
    assert (state, took) == ("imported", True)
    helper = confined._ZYGOTE
    assert helper is not None and len(os.listdir(f"/proc/{helper.process.pid}/task")) == 1


def test_sql_runs_beside_a_lake_this_process_holds(lake_target, file_target) -> None:
    """A lake attached in the calling process (its DuckDB worker threads and catalogue sessions, as
    in a notebook that read it): `sql` on it and on a file, from two threads at once, all answer."""
    from headatlas.service.storage import db

    backend = lake_target.backend()
    with db.transaction(backend, read_only=True) as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM runs").scalar() == 0
    assert confined.threads_now() > 2
    answers: list[object] = []

    def ask(where) -> None:
        try:
            answers.append(run_readonly_sql(where, "SELECT count(*) FROM runs").rows)
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            answers.append(exc)

    threads = [threading.Thread(target=ask, args=(where,)) for where in (backend, file_target, file_target)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert answers == [[(0,)]] * 3
    lake_target.release()


def test_a_single_threaded_process_forks_its_query_directly(file_target) -> None:
    """A caller that runs one thread (a script that imports the storage package alone and stops
    DuckDB's default worker threads) forks its query's process itself: no helper is started. A
    process of its own: this one runs other threads."""
    script = (
        "import sys\n"
        "from headatlas.service.storage import confined\n"
        "from headatlas.service.storage.readonly import run_readonly_sql\n"
        "assert confined.single_threaded(), confined.threads_now()\n"
        "rows = run_readonly_sql(sys.argv[1], 'SELECT count(*) FROM runs').rows\n"
        "print(rows, confined._ZYGOTE is None, confined.threads_now())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(file_target)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[(0,)]", "True", "1"]


# --- the catalogue roles of docs/distributed.md ------------------------------------------------------


def _roles_sql(prefix: str) -> str:
    """docs/distributed.md's catalogue roles, for the database and roles ``prefix``…"""
    text = (ROOT / "docs" / "distributed.md").read_text(encoding="utf-8")
    block = text.split("**Catalogue roles.**", 1)[1].split("```sql\n", 1)[1].split("```", 1)[0]
    block = "\n".join(line.split("--", 1)[0] for line in block.splitlines())
    return re.sub(r"\batlas", prefix, block).replace("PASSWORD '…'", "PASSWORD 'x'")


def test_the_catalogue_roles_of_the_docs_hold(tmp_path) -> None:
    """The roles docs/distributed.md recommends, as written there: the owner creates the lake
    (`db upgrade`), the writer stores, the reader runs `sql`; and a client holding the reader's or the
    writer's password (not the sandbox, which holds no session) can neither read a server file,
    make a large object, write the catalogue (the reader), nor end another role's session."""
    import lake_support

    if lake_support.unavailable():
        pytest.skip(lake_support.unavailable())
    from headatlas.service.storage import db
    from headatlas.service.storage.backends.lake import LakeBackend

    prefix = f"ha_roles_{os.getpid()}"
    statements = _roles_sql(prefix).split(";")
    database_level = [s for s in statements if re.search(r"CREATE (ROLE|DATABASE)", s)]
    in_database = [s for s in statements if s.strip() and s not in database_level]
    data = tmp_path / "lake-data"
    data.mkdir()

    def as_role(role: str, sql: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                "psql",
                f"{lake_support.PG.replace('user=postgres', '')} user={role} dbname={prefix} connect_timeout=5",
                "-v",
                "ON_ERROR_STOP=1",
                "-qtAc",
                sql,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def url(role: str) -> str:
        return f"ducklake:postgres:dbname={prefix} {lake_support.PG.replace('user=postgres', '')} user={role}"

    writer_session = None
    try:
        for sql in database_level:
            assert lake_support._psql(sql).returncode == 0, sql
        for sql in in_database:
            done = lake_support._psql(sql, dbname=prefix)
            assert done.returncode == 0, (sql, done.stderr)
        db.upgrade(LakeBackend(url(prefix), data_path=data))  # the owner creates the catalogue
        writer = LakeBackend(url(f"{prefix}_writer"), data_path=data)
        with db.transaction(writer) as conn:  # a snapshot written: catalogue rows and a Parquet file
            conn.exec_driver_sql("INSERT INTO database_info VALUES ('roles-test', 'x')")
        reader = LakeBackend(url(f"{prefix}_reader"), data_path=data)
        assert run_readonly_sql(reader, "SELECT value FROM database_info WHERE key = 'roles-test'").rows == [("x",)]
        writer_session = subprocess.Popen(
            [
                "psql",
                f"{lake_support.PG.replace('user=postgres', '')} user={prefix}_writer dbname={prefix}",
                "-qtAc",
                "SELECT pg_sleep(60)",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)
        others = {
            f"{prefix}_reader": f"{prefix}_writer",
            f"{prefix}_writer": prefix,
        }  # whose sessions each tries to end
        for role, other in others.items():
            for sql in (
                "SELECT pg_read_file('/etc/hostname')",
                "SELECT lo_from_bytea(0, 'x'::bytea)",
                f"SELECT bool_and(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = '{other}'",
            ):
                done = as_role(role, sql)
                denied = re.search("permission denied|must be a member of the role", done.stderr)
                assert done.returncode != 0 and denied, (role, sql, done.stdout, done.stderr)
        done = as_role(f"{prefix}_reader", "INSERT INTO ducklake_metadata SELECT * FROM ducklake_metadata LIMIT 0")
        assert done.returncode != 0 and "permission denied" in done.stderr, done.stderr
        assert writer_session.poll() is None  # the writer's session lives on
    finally:
        if writer_session is not None:
            writer_session.kill()
            writer_session.wait()
        from headatlas.service.storage.backends.lake import release

        for role in (prefix, f"{prefix}_writer", f"{prefix}_reader"):
            release(LakeBackend(url(role), data_path=data))
        lake_support.drop_database(prefix)
        for role in (f"{prefix}_reader", f"{prefix}_writer", prefix):
            lake_support._psql(f"DROP ROLE IF EXISTS {role}")
