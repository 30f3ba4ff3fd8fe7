"""Transactions on headatlas files share DuckDB instances kept between them (file_instances): each
file is attached to a kept instance while this process uses it and detached after, so what a
connection sees, what the file holds afterwards and who may open it then are what a connection
of the file's own instance gave."""

from __future__ import annotations

import gc
import os

import duckdb
import pytest
from sqlalchemy import text

from headatlas.service.storage import db as dbmod
from headatlas.service.storage.backends import file_instances
from headatlas.service.storage.backends.file import FileBackend
from headatlas.service.storage.store import Store
from tests.test_held_file import _another_process_opens  # opened for writing, or refused

real_connect = duckdb.connect


@pytest.fixture()
def two_files(tmp_path):
    paths = [tmp_path / "first.duckdb", tmp_path / "second.duckdb"]
    for path in paths:
        Store(path).ensure_schema()
    return paths


def _instances_made(monkeypatch) -> list[str]:
    made: list[str] = []

    def counting(database=":memory:", *args, **kwargs):
        made.append(str(database))
        return real_connect(database, *args, **kwargs)

    monkeypatch.setattr(file_instances.duckdb, "connect", counting)
    return made


def test_one_instance_serves_files_in_turn_and_each_file_is_free_and_checkpointed_after(two_files, monkeypatch):
    made = _instances_made(monkeypatch)
    attached: list[str] = []
    real_attach = file_instances.attach
    monkeypatch.setattr(file_instances, "attach", lambda *a, **k: attached.append(a[1]) or real_attach(*a, **k))
    for round_ in range(2):
        for path in two_files:
            with dbmod.transaction(FileBackend(path)) as conn:
                conn.execute(text(f"CREATE TABLE kept_{round_} AS SELECT {round_} AS x"))
            assert not file_instances.attached(str(path.absolute()))
            assert not os.path.exists(f"{path}.wal")  # detached: checkpointed, as closing did
    assert len(made) <= 1  # at most one instance made, none where one was kept already
    assert len(attached) == 4  # each transaction attached its file to a kept instance
    for path in two_files:
        assert _another_process_opens(path).strip() == "opened"  # the lock released
        with real_connect(str(path), read_only=True) as conn:
            assert conn.execute("SELECT x FROM kept_0 UNION ALL SELECT x FROM kept_1").fetchall() == [(0,), (1,)]


def test_a_connection_sees_its_file_as_the_files_own_instance_showed_it(two_files):
    first, second = two_files
    with real_connect(str(first), read_only=True) as own:
        expected = {
            "database": own.execute("SELECT current_database()").fetchone(),
            "tables": own.execute("SELECT table_name FROM information_schema.tables ORDER BY 1").fetchall(),
            "views": own.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1").fetchall(),
        }
    with FileBackend(second).held(), dbmod.transaction(FileBackend(first), read_only=True) as conn:
        # another file open in this process meanwhile is not in view: each instance holds one file
        seen = {
            "database": tuple(conn.execute(text("SELECT current_database()")).one()),
            "tables": [
                tuple(r) for r in conn.execute(text("SELECT table_name FROM information_schema.tables ORDER BY 1"))
            ],
            "views": [
                tuple(r)
                for r in conn.execute(text("SELECT view_name FROM duckdb_views() WHERE NOT internal ORDER BY 1"))
            ],
        }
    assert seen == expected and seen["database"] == ("first",) and len(seen["tables"]) > 10


def test_a_global_setting_made_in_a_transaction_ends_with_it(two_files, monkeypatch):
    monkeypatch.setenv("HEADATLAS_DUCKDB_THREADS", "1")
    first, second = two_files
    with dbmod.transaction(FileBackend(first)) as conn:
        conn.execute(text("SET threads = 3"))
        assert conn.execute(text("SELECT current_setting('threads')")).scalar() == 3
    with dbmod.transaction(FileBackend(second)) as conn:
        assert conn.execute(text("SELECT current_setting('threads')")).scalar() == 1


@pytest.mark.parametrize(
    "how",
    ["execute", "lower case after a comment", "second statement", "sql", "further cursor"],
)
def test_a_global_setting_made_any_way_ends_with_its_transaction(two_files, monkeypatch, how):
    """The settings are read back only after a statement that may change them (the usual
    transaction runs none): each way a transaction can change one is seen."""
    monkeypatch.setenv("HEADATLAS_DUCKDB_THREADS", "1")
    first, second = two_files
    with dbmod.transaction(FileBackend(first)) as conn:
        raw = dbmod.driver_connection(conn)
        if how == "execute":
            raw.execute("SET threads = 3")
        elif how == "lower case after a comment":
            raw.execute("/* more threads */ set threads = 3")
        elif how == "second statement":
            raw.execute("SELECT 1; SET threads = 3")
        elif how == "sql":
            raw.sql("SET threads = 3")
        else:
            raw.cursor().execute("SET threads = 3")
        assert conn.execute(text("SELECT current_setting('threads')")).scalar() == 3
    with dbmod.transaction(FileBackend(second)) as conn:
        assert conn.execute(text("SELECT current_setting('threads')")).scalar() == 1


def test_a_transaction_that_changes_no_setting_does_not_read_them_back(two_files, monkeypatch):
    first, second = two_files
    with dbmod.transaction(FileBackend(first)) as conn:  # the instances made, their settings read
        conn.execute(text("SELECT count(*) FROM runs")).scalar()
    reads: list[int] = []
    real = file_instances._settings
    monkeypatch.setattr(file_instances, "_settings", lambda instance: reads.append(1) or real(instance))
    for path in (first, second):
        with dbmod.transaction(FileBackend(path)) as conn:
            conn.execute(text("INSERT INTO database_info VALUES ('note', 'x') ON CONFLICT DO NOTHING"))
            conn.execute(text("SELECT count(*) FROM runs")).scalar()
    assert reads == []
    with dbmod.transaction(FileBackend(first)) as conn:
        conn.execute(text("SET threads = 2"))
    assert reads == [1, 1]  # read, restored, read again


def test_a_file_named_as_an_instances_own_catalogue_opens_on_an_instance_of_its_own(tmp_path):
    for stem in ("memory", "system"):
        path = tmp_path / f"{stem}.duckdb"
        Store(path).ensure_schema()
        with real_connect(str(path), read_only=True) as own:
            (name,) = own.execute("SELECT current_database()").fetchone()  # type: ignore[misc]
        with dbmod.transaction(FileBackend(path)) as conn:
            assert conn.execute(text("SELECT current_database()")).scalar() == name
            assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0


def test_a_forked_child_opens_the_file_on_an_instance_of_its_own(two_files):
    first, _ = two_files
    with dbmod.transaction(FileBackend(first)) as conn:
        conn.execute(text("SELECT 1")).scalar()
    kept = list(file_instances._IDLE)
    assert kept  # an empty instance waits in the parent
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's instance forgotten, the file opened afresh
        ok = False
        try:
            ok = not file_instances._IDLE
            with dbmod.transaction(FileBackend(first), read_only=True) as conn:
                ok = ok and conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert file_instances._IDLE == kept  # the parent's untouched


def test_a_connection_dropped_unclosed_lets_its_file_go(two_files):
    first, _ = two_files
    connection = FileBackend(first).connect()
    assert connection.execute("SELECT count(*) FROM runs").fetchone() == (0,)
    assert file_instances.attached(str(first.absolute()))
    del connection
    gc.collect()
    assert not file_instances.attached(str(first.absolute()))
    assert _another_process_opens(first).strip() == "opened"


def test_a_file_is_named_as_duckdb_names_it_and_a_further_cursor_is_in_it_too(tmp_path):
    path = tmp_path / "run.v2.duckdb"
    Store(path).ensure_schema()
    with real_connect(str(path), read_only=True) as own:
        (name,) = own.execute("SELECT current_database()").fetchone()  # type: ignore[misc]
    connection = FileBackend(path).connect()
    try:
        assert connection.execute("SELECT current_database()").fetchone() == (name,)
        assert connection.cursor().execute("SELECT count(*) FROM runs").fetchone() == (0,)
    finally:
        connection.close()
