"""Distributed runs into a lake (real Redis, `headatlas writer` ×2, `headatlas worker`, this
machine's PostgreSQL): two writers store one run side by side and it equals the embedded run on
a file, every count; a reader holding one snapshot while they commit sees nothing move and fails
no one; a writer killed with kill -9 mid-run leaves every window counted once; a writer stopped
while it holds messages, then resumed beside the other, leaves one ledger row per batch and a lake
that `db copy` copies."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
from conftest import invoke_cli, run_cli
from queue_support import (
    Cluster,
    RedisServer,
    assert_counted_once,
    assert_new_columns_present,
    assert_same_statistics,
    make_corpus,
    stored,
)
from sqlalchemy import text

from headatlas.service.params import AnalysisParams

pytestmark = pytest.mark.integration

ARGS = ["--model", "random:tiny", "--seq-len", "32", "--batch-size", "2"]


@pytest.fixture()
def cluster(lake, tmp_path):
    """Redis of our own, and two writers of the lake (the second joins the first)."""
    yield from _two_writers(lake, tmp_path)


@pytest.fixture()
def short_leases(lake, tmp_path):
    """As ``cluster``, with 4 s leases: a stopped writer's messages go back to the queue soon."""
    yield from _two_writers(lake, tmp_path, HEADATLAS_LEASE_S="4")


def _two_writers(lake, tmp_path, **env):
    folder = tmp_path / "queue"
    folder.mkdir()
    server = RedisServer(folder / "redis").start()
    cluster = Cluster(server.url, folder)
    cluster.db = lake.url
    cluster.env.update(lake.env, **env)
    try:
        cluster._start("writer", "writer")
        _wait(lambda: _writers(cluster) == 1, "the first writer")
        cluster._start("writer-2", "writer")
        _wait(lambda: _writers(cluster) == 2, "the second writer")
        yield cluster
    finally:
        cluster.stop()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _writers(cluster) -> int:
    from headatlas.workers.lease import helpers, holder

    first, _raw = holder(cluster.redis)
    return (first is not None and first.database_id is not None) + len(helpers(cluster.redis))


def _wait(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_a_run_stored_by_two_writers_equals_the_embedded_run_while_a_reader_holds_a_snapshot(
    cluster, lake, tiny_model, demo_corpus, tmp_path
):
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=4, tag="lakequeue")
    cluster.start_worker()
    submitted: list[str] = []
    thread = threading.Thread(target=lambda: submitted.append(cluster.submit(corpus, *ARGS, "--wait")))

    # a reader holds one snapshot while the writers commit: until they have stored batches of the
    # run (Redis counts what they committed) and at least 5 s
    store = Store(lake.url, data_path=lake.data_path)
    started = time.monotonic()
    seen, committed = set(), 0
    with store.read() as conn:
        before = conn.execute(text("SELECT count(*) FROM batches")).scalar()
        thread.start()
        while committed < 4 or time.monotonic() - started < 5:
            assert time.monotonic() - started < 120, f"no batch committed while the reader held; {cluster.logs()}"
            seen.add(conn.execute(text("SELECT count(*) FROM batches")).scalar())
            conn.execute(text("SELECT count(*), sum(high_pairs) FROM head_stats")).all()
            time.sleep(0.5)
            committed = cluster.stored_batches()
    assert seen == {before}  # its snapshot: nothing moved under it
    thread.join(300)
    assert submitted, cluster.logs()
    run_id = store.get_run(submitted[0]).run_id
    assert cluster.wait_status(submitted[0]) == "done"

    embedded_db = tmp_path / "embedded.duckdb"
    run = analyze_corpus(
        str(corpus),
        store=Store(embedded_db),
        model=tiny_model,
        params=AnalysisParams(seq_len=32),
        corpus=survey_corpus(str(corpus)),
        batch_size=2,
    )
    assert store.get_run(run_id).run_key == run.run_key
    queued, embedded = stored(cluster.db, run_id), stored(str(embedded_db), run.run_id)
    assert len(embedded["run_windows"]) > 8
    assert_new_columns_present(cluster.db, run_id)
    assert_same_statistics(queued, embedded)
    assert_counted_once(cluster.db, run_id)
    status = run_cli("status", submitted[0], "--format", "json", env=cluster.env)
    assert status.returncode == 0 and '"done"' in status.stdout, status.stderr
    logs = cluster.logs()
    assert "storing beside it" in logs  # the second writer joined the first
    assert "Traceback" not in logs


def test_a_writer_killed_mid_run_leaves_every_window_counted_once(cluster, lake, demo_corpus, tmp_path):
    from headatlas.workers.ledger import INGEST, PROCESSING

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=6, tag="lakekill")
    cluster.start_worker()
    cluster.start_worker("worker-2")
    submitted: list[str] = []
    thread = threading.Thread(target=lambda: submitted.append(cluster.submit(corpus, *ARGS, "--wait")))
    thread.start()
    # the first writer has taken messages and not committed them: kill -9 it there
    _wait(lambda: cluster.redis.llen(PROCESSING) > 0, "the first writer to take messages", timeout=120)
    cluster.kill("writer")
    thread.join(300)
    assert submitted, cluster.logs()
    assert cluster.wait_status(submitted[0], timeout=180) == "done"
    # the messages it held are queued again once its lease lapses: after the run's end where it
    # had committed them before it was killed; then they are stored again, and counted once
    _wait(lambda: "the first writer of this lake is gone" in cluster.logs(), "the first writer's lease taken over")
    _wait(lambda: cluster.redis.llen(INGEST) == 0 and cluster.redis.llen(PROCESSING) == 0, "the queue drained")
    from headatlas.service.storage.store import Store

    run_id = Store(lake.url, data_path=lake.data_path).get_run(submitted[0]).run_id
    assert_counted_once(cluster.db, run_id)


def test_a_writer_stopped_while_it_holds_messages_then_resumed_leaves_one_ledger_row_per_batch(
    short_leases, lake, demo_corpus, tmp_path
):
    import os
    import signal

    from headatlas.service.storage.store import Store
    from headatlas.workers.ledger import processing_lists

    cluster = short_leases
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=4, tag="lakestop")
    cluster.start_worker()
    cluster.start_worker("worker-2")
    submitted: list[str] = []
    thread = threading.Thread(target=lambda: submitted.append(cluster.submit(corpus, *ARGS, "--wait")))
    thread.start()
    # a writer has taken messages and not committed them: stop it there (SIGSTOP, as a stalled host)
    holding: list[str] = []
    _wait(
        lambda: holding.extend(n for n in processing_lists(cluster.redis) if cluster.redis.llen(n)) or holding,
        "a writer to take messages",
        timeout=120,
    )
    name = "writer" if holding[0].endswith(":processing") else "writer-2"
    stopped = cluster.procs[name]
    os.killpg(stopped.pid, signal.SIGSTOP)
    try:
        # past its lease the other writer puts its messages back on the queue and stores them
        _wait(lambda: not cluster.redis.llen(holding[0]), "its messages to go back to the queue", timeout=60)
        time.sleep(2)
    finally:
        os.killpg(stopped.pid, signal.SIGCONT)  # it resumes beside the other, the group still in hand
    thread.join(300)
    assert submitted, cluster.logs()
    assert cluster.wait_status(submitted[0], timeout=180) == "done"
    run_id = Store(lake.url, data_path=lake.data_path).get_run(submitted[0]).run_id
    assert_counted_once(cluster.db, run_id)
    with Store(lake.url, data_path=lake.data_path).read() as conn:
        twice = conn.execute(
            text("SELECT batch_id, list(status) FROM batches GROUP BY batch_id HAVING count(*) > 1")
        ).all()
    assert not twice, f"batches with more than one ledger row: {twice}"
    copied = invoke_cli("db", "copy", lake.url, str(tmp_path / "copy.duckdb"), env=cluster.env)
    assert copied.returncode == 0 and "Traceback" not in copied.stderr, copied.stderr
