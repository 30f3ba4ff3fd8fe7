"""Back-to-back transactions on one file share one opening of it (FileBackend.held), and a finished
run's derivation reads each replicate view once (query_support.shared_reads): both only save the
cost of opening and of planning, so what they return must be what the plain path returns."""

from __future__ import annotations

import contextlib
import os

import duckdb
import pytest
from sqlalchemy import text
from typer.testing import CliRunner

from headatlas.cli.main import app
from headatlas.service.storage import db as dbmod
from headatlas.service.storage.backends import file as filebackend
from headatlas.service.storage.backends import file_instances
from headatlas.service.storage.backends.file import FileBackend
from headatlas.service.storage.store import Store

real_connect = duckdb.connect


def _count_connects(monkeypatch) -> list[str]:
    """Every opening of a file from here on: a DuckDB instance made on it, or the file attached to
    an instance kept between transactions (file_instances)."""
    opened: list[str] = []

    def counting(database=":memory:", *args, **kwargs):
        opened.append(str(database))
        return real_connect(database, *args, **kwargs)

    real_attach = file_instances.attach

    def counting_attach(instance, where, alias, *, read_only):
        opened.append(where)
        return real_attach(instance, where, alias, read_only=read_only)

    monkeypatch.setattr(filebackend.duckdb, "connect", counting)
    monkeypatch.setattr(file_instances, "attach", counting_attach)
    return opened


@pytest.fixture()
def stored(tmp_path):
    path = tmp_path / "h.duckdb"
    Store(path).ensure_schema()
    return path


def test_within_a_hold_transactions_open_no_new_instance_and_the_file_is_free_after(stored, monkeypatch):
    backend = FileBackend(stored)
    opened = _count_connects(monkeypatch)
    with backend.held():
        assert len(opened) == 1  # the hold's own
        for read_only in (False, True, False):
            with dbmod.transaction(backend, read_only=read_only) as conn:
                conn.execute(text("SELECT count(*) FROM runs")).scalar()
        with dbmod.transaction(backend) as conn:
            conn.execute(text("CREATE TABLE kept (x INTEGER)"))
            conn.execute(text("INSERT INTO kept VALUES (7)"))
        with dbmod.transaction(backend, read_only=True) as conn:  # another connection sees the commit
            assert conn.execute(text("SELECT x FROM kept")).scalar() == 7
        assert len(opened) == 1
        # the instance is open read-write: a read-only one in this process is refused meanwhile
        with pytest.raises(duckdb.Error):
            real_connect(str(stored.absolute()), read_only=True).close()
    assert filebackend._HELD == {}
    # closed (and checkpointed) on leaving: the file opens read-only, with what was committed
    with real_connect(str(stored), read_only=True) as conn:
        assert conn.execute("SELECT x FROM kept").fetchone() == (7,)
    assert not os.path.exists(f"{stored}.wal")
    with dbmod.transaction(backend, read_only=True) as conn:  # and each transaction opens it again
        conn.execute(text("SELECT 1")).scalar()
    assert len(opened) == 2


def test_nothing_is_held_for_a_missing_file_and_a_nested_hold_shares_the_outer_one(tmp_path, stored, monkeypatch):
    missing = FileBackend(tmp_path / "none.duckdb")
    with missing.held():
        assert filebackend._HELD == {}
    assert not (tmp_path / "none.duckdb").exists()  # a hold never creates a database
    backend = FileBackend(stored)
    opened = _count_connects(monkeypatch)
    with backend.held():
        with backend.held():
            with dbmod.transaction(backend) as conn:
                conn.execute(text("SELECT 1")).scalar()
        assert list(filebackend._HELD) == [str(stored.absolute())]  # the inner one left it open
    assert filebackend._HELD == {} and len(opened) == 1


def test_a_failed_transaction_inside_a_hold_rolls_back_and_the_hold_still_closes(stored):
    backend = FileBackend(stored)
    with pytest.raises(RuntimeError):
        with backend.held():
            with dbmod.transaction(backend) as conn:
                conn.execute(text("CREATE TABLE gone (x INTEGER)"))
                raise RuntimeError("stop")
    assert filebackend._HELD == {}
    with duckdb.connect(str(stored), read_only=True) as conn:
        assert conn.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'gone'").fetchone() == (0,)


def test_a_forked_child_forgets_its_parents_hold(stored):
    backend = FileBackend(stored)
    with backend.held():
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: no hold, and it never closes the parent's instance
            os.close(read)
            os.write(write, b"1" if filebackend._HELD == {} else b"0")
            os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.waitpid(pid, 0)
        assert answer == b"1"
        with dbmod.transaction(backend) as conn:  # the parent's instance is still whole
            assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0


def test_a_run_analysed_with_the_holds_reads_back_like_one_without(tmp_path, demo_corpus, monkeypatch):
    """The embedded analysis holds its file at its start and end: the same stored run and derived
    results as with every transaction opening the file (the holds turned off)."""
    runner = CliRunner()
    args = ["--model", "random:tiny", "--seq-len", "32", "--name", "r"]

    def analysed(path):
        result = runner.invoke(app, ["analyze", str(demo_corpus), "--db", str(path), *args])
        assert result.exit_code == 0, result.output
        with duckdb.connect(str(path), read_only=True) as conn:
            runs = conn.execute(
                "SELECT run_key, status, (SELECT count(*) FROM run_windows), (SELECT count(*) FROM head_stats) FROM runs"
            ).fetchall()
            results = conn.execute("SELECT kind, columns, rows FROM run_results ORDER BY kind").fetchall()
        return runs, results

    held = analysed(tmp_path / "held.duckdb")
    monkeypatch.setattr(FileBackend, "held", lambda self: contextlib.nullcontext())
    plain = analysed(tmp_path / "plain.duckdb")
    assert held[0] == plain[0] and held[0][0][1] == "done"
    assert [r[0] for r in held[1]] and held[1] == plain[1]


def test_a_derivation_reads_each_replicate_view_once_and_returns_what_the_readers_compute(tmp_path, demo_corpus):
    from headatlas.service.reports import layer_queries, queries, roles, stored
    from headatlas.service.storage.run_results import computed

    path = tmp_path / "d.duckdb"
    result = CliRunner().invoke(
        app, ["analyze", str(demo_corpus), "--db", str(path), "--model", "random:tiny", "--seq-len", "32"]
    )
    assert result.exit_code == 0, result.output
    statements: list[str] = []
    with Store(path).read() as conn:
        from sqlalchemy import event

        engine = conn.engine
        listener = lambda *a: statements.append(a[2])  # noqa: E731 - (conn, cursor, statement, …)
        event.listen(engine, "before_cursor_execute", listener)
        try:
            derived = stored.derive(conn, 1)
        finally:
            event.remove(engine, "before_cursor_execute", listener)
        with computed():  # each reader on its own, as a run whose stored results are stale is read
            alone = {
                "heads": queries.heads(conn, 1, ci=True),
                "roles": roles.roles(conn, 1, stability=True),
                "layers": layer_queries.layers(conn, 1, ci=True),
            }
    for view in ("head_metrics_reps", "layer_metrics_reps"):
        # the whole run's rows (each half's statements read the view over its own groups' tables, WITH …)
        reads = [s for s in statements if f"FROM {view} WHERE run_id" in s and not s.lstrip().startswith("WITH")]
        assert len(reads) == 1, (view, [s[:120] for s in reads])
    for kind, rows in alone.items():
        assert derived[kind] == rows, kind


def _another_process_opens(path) -> str:
    """What a second process gets when it opens ``path`` for writing: 'opened' or DuckDB's refusal."""
    import subprocess
    import sys

    probe = (
        "import duckdb, sys\n"
        "try:\n    duckdb.connect(sys.argv[1]).close(); print('opened')\n"
        "except duckdb.Error as exc:\n    print('refused:', exc)\n"
    )
    return subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=60).stdout


def test_a_file_open_here_stays_locked_to_other_processes_while_this_one_checks_it(stored):
    """DuckDB locks its file with POSIX record locks, which the kernel drops when the process closes
    any descriptor of the file: reading the header (every transaction's check) while a hold or an
    outer transaction had the file open let another process open it for writing too — two writers on
    one file (seen: a cluster file whose database_id row every process missed for minutes)."""
    backend = FileBackend(stored)
    with backend.held():
        with dbmod.transaction(backend, read_only=True) as conn:  # its check comes first
            conn.execute(text("SELECT 1")).scalar()
        assert _another_process_opens(stored).startswith("refused: IO Error: Could not set lock")
    with dbmod.transaction(backend) as conn:
        backend.check(write=True)  # e.g. a nested transaction's check, in the same thread
        assert _another_process_opens(stored).startswith("refused: IO Error: Could not set lock")
    assert _another_process_opens(stored).strip() == "opened"  # free once closed (and the probe can fail)
    # a file not open here is still read and judged: a damaged one refused
    cut = stored.parent / "cut.duckdb"
    cut.write_bytes(stored.read_bytes()[:5000])
    with pytest.raises(dbmod.DatabaseFileError, match="cut short"):
        FileBackend(cut).check(write=False)
