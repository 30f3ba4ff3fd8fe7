"""A reader that holds the database file longer than the lock wait delays an embedded run's
storing; it never fails the run (the finished batches wait in memory and are stored once the
file is free), and every window is counted once."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
from sqlalchemy import text

from headatlas.service.params import AnalysisParams
from headatlas.service.storage import db

pytestmark = pytest.mark.integration

HOLD_S = 6.0

# The reader opens the file as `sql` does (a read-only connection), trying again while the run is
# storing a batch (the file is then held for writing: a busy machine can start it at that moment).
_HOLDER = """
import sys, time, duckdb
deadline = time.monotonic() + 60
while True:
    try:
        con = duckdb.connect(sys.argv[1], read_only=True)
        break
    except duckdb.IOException:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.01)
con.execute("SELECT count(*) FROM runs").fetchall()
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def test_a_reader_holding_the_file_delays_an_embedded_run_without_failing_it(tiny_model, tmp_path, monkeypatch, caplog):
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    monkeypatch.setattr(db, "LOCK_WAIT_S", 0.5)  # a reader past the wait, without waiting 30 s
    path = tmp_path / "c.duckdb"
    store = Store(path)
    store.ensure_schema()
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(f"Paragraph {k}: the cat sat on the mat, and the dog did not.\n\n" for k in range(12)))
    holder: list = []
    analysed = []

    def progress(windows: int, _chars: int) -> None:
        analysed.append(windows)
        if not holder:  # after the first batch: the reader takes the file for HOLD_S
            proc = subprocess.Popen(
                [sys.executable, "-c", _HOLDER, str(path), str(HOLD_S)], stdout=subprocess.PIPE, text=True
            )
            assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
            holder.append(proc)

    caplog.set_level(logging.WARNING, logger="headatlas.engine")
    params = AnalysisParams(seq_len=32)
    summary = survey_corpus(str(corpus))
    try:
        run = analyze_corpus(
            str(corpus),
            store=store,
            model=tiny_model,
            params=params,
            corpus=summary,
            batch_size=2,
            flush_s=0.0,
            progress=progress,
        )
    finally:
        for proc in holder[:1]:
            proc.kill()
            proc.wait()
    assert holder, "the run ended before a reader could hold the file"
    assert run.status == "done", run.error
    assert any("the run keeps its results and tries again" in r.getMessage() for r in caplog.records)
    with db.transaction(path, read_only=True) as conn:
        q = lambda sql: conn.execute(text(sql), {"r": run.run_id}).scalar()  # noqa: E731
        counted = q("SELECT count(*) FROM run_windows WHERE run_id = :r")
        assert counted == q("SELECT count(DISTINCT window_id) FROM run_windows WHERE run_id = :r")
        assert q("SELECT sum(windows) FROM run_chance WHERE run_id = :r") == counted
    assert len(analysed) >= 3  # batches after the first waited for the reader
    assert counted == sum(analysed) == 12  # every window analysed, counted once


def test_a_lock_refused_inside_a_transaction_is_busy_and_nothing_is_written(tmp_path):
    """DuckDB may refuse a commit on another process's lock (on the .wal file): the transaction is
    rolled back and the error is StoreBusy, which the writer and the embedded run retry, instead of
    an error that stops them."""
    import duckdb
    from sqlalchemy import text

    from headatlas.service.errors import StoreBusy
    from headatlas.service.storage import db

    path = tmp_path / "busy.duckdb"
    with db.transaction(path) as conn:
        conn.execute(text("CREATE TABLE t (x INTEGER)"))
    refused = (
        'Failed to commit: Could not set lock on file "busy.duckdb.wal": Conflicting lock is held in python (PID 1)'
    )
    with pytest.raises(StoreBusy, match="nothing was written, retry"):
        with db.transaction(path) as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))
            raise duckdb.TransactionException(refused)
    with pytest.raises(ValueError, match="lock"):  # other errors pass as they are
        with db.transaction(path) as conn:
            raise ValueError("a lock of hair")
    with db.transaction(path, read_only=True) as conn:
        assert conn.execute(text("SELECT count(*) FROM t")).scalar() == 0


def test_a_process_forked_while_another_thread_holds_the_process_lock_opens_the_file(tmp_path):
    """The file lock of this process (threads open the file in turn) is new in a forked child: a
    child forked while another thread held it opened nothing, ever (it waited for a thread it
    does not have)."""
    import os
    import threading

    from sqlalchemy import text

    from headatlas.service.storage.backends.file import PROCESS_LOCK
    from headatlas.service.storage.db import transaction, upgrade

    db = str(tmp_path / "fork.duckdb")
    upgrade(db)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with PROCESS_LOCK:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:  # the child: reads the file, or is killed by the parent after 20 s
            code = 1
            try:
                with transaction(db, read_only=True) as conn:
                    code = 0 if conn.execute(text("SELECT count(*) FROM runs")).scalar() == 0 else 1
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child waited 20 s for a lock held by a thread it does not have")
        assert os.WIFEXITED(done[1]) and os.WEXITSTATUS(done[1]) == 0
    finally:
        release.set()
        holder.join()
