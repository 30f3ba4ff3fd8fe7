"""Faults during a distributed run, each ending with the run complete and every window counted
once: a worker killed mid-batch, the writer killed mid-ingest, Redis restarted mid-run."""

from __future__ import annotations

import json
import time

import pytest
import redis
from queue_support import (
    Cluster,
    RedisServer,
    assert_counted_once,
    assert_whole_batches,
    kill_mid_batch,
    make_corpus,
    submit_lost_worker_run,
)

from headatlas.service.config import Settings
from headatlas.service.params import AnalysisParams
from headatlas.workers.ledger import key

pytestmark = pytest.mark.integration

MODEL = "random:4,4,256"  # slow enough (a few tenths of a second a batch) to be caught mid-batch
PARAMS = AnalysisParams(seq_len=128)


@pytest.fixture()
def shared(queue_cluster):
    return queue_cluster


def _submit(cluster, corpus):
    from headatlas.workers.submit import submit

    settings = Settings(broker_url=cluster.env["HEADATLAS_BROKER_URL"], db=cluster.db)
    return submit(str(corpus), settings=settings, model=MODEL, dtype="float32", params=PARAMS, batch_size=4)


def _wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def test_worker_killed_mid_batch(shared, demo_corpus, tmp_path):
    # the lost-worker run (76 batches), not 10: a worker that had built its model in an earlier
    # test, on an idle machine, stored all 10 before the first look for a batch to kill (seen after
    # test_lost_worker_load, whose worker the shared cluster keeps; kill_mid_batch then waited 240 s)
    sub = submit_lost_worker_run(shared, tmp_path, demo_corpus, "workerkill")
    run_id = shared.run_id(sub)
    # the shared helper: a kill between two batches is tried again, and a worker that never
    # starts one fails with the processes' logs (seen once in CI: no batch in 150 s, and no clue)
    victim, _entry, _killed = kill_mid_batch(shared, key("running", sub.run_key, sub.database_id))
    victim = int(victim)
    shared.start_worker()
    assert shared.wait_status(sub.name, timeout=150) == "done"
    assert_counted_once(shared.db, run_id)
    attempts = int(shared.redis.hget(key("attempts", sub.run_key, sub.database_id), victim))
    assert attempts >= 2  # it was really cut short, and analysed again


def test_writer_killed_mid_ingest(shared, demo_corpus, tmp_path):
    from headatlas.service.storage.db import transaction

    corpus = make_corpus(tmp_path, demo_corpus, paragraphs=4, tag="writerkill")
    sub = _submit(shared, corpus)
    run_id = shared.run_id(sub)
    _wait_for(lambda: shared.redis.hget("headatlas:writer", "state") == b"ingesting", what="an ingest")
    shared.kill("writer")
    with transaction(shared.db, read_only=True) as conn:  # what a reader sees now: whole batches only
        from sqlalchemy import text

        done = conn.execute(
            text("SELECT count(*) FROM batches WHERE run_id = :r AND status = 'done'"), {"r": run_id}
        ).scalar()
        assert_whole_batches(conn, run_id, done, 4 * 4)
    assert done < sub.batches
    shared.start_writer()
    assert shared.wait_status(sub.name, timeout=150) == "done"
    assert_counted_once(shared.db, run_id)


def test_redis_restarted_mid_run(demo_corpus, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    cluster = Cluster(server.url, tmp_path)
    try:
        cluster.start_writer()
        cluster.start_worker()
        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=6, tag="redisrestart")
        sub = _submit(cluster, corpus)
        run_id = cluster.run_id(sub)
        client = redis.Redis.from_url(server.url)
        _wait_for(lambda: client.scard(key("done", sub.run_key, sub.database_id)) >= 1, what="a first stored batch")
        server.stop()
        time.sleep(1.0)
        server.start()
        assert cluster.wait_status(sub.name, timeout=180) == "done"
        assert_counted_once(cluster.db, run_id)
    finally:
        cluster.stop()
        server.stop()


def test_a_task_that_lost_the_broker_rejects_once_it_is_back(tmp_path, monkeypatch):
    """A batch's write met a Redis restarting: the task waits for Redis to answer before its
    Reject goes to Celery (a reject sent while it is away is only logged, and left a solo
    worker consuming nothing after Redis was back)."""
    import threading

    from celery.exceptions import Reject

    from headatlas.workers import tasks

    server = RedisServer(tmp_path / "redis").start()
    monkeypatch.setattr(tasks, "_settings", lambda: Settings(broker_url=server.url, task_time_limit_s=30.0))
    client = redis.Redis.from_url(server.url)
    try:
        server.stop()
        threading.Timer(1.5, server.start).start()
        began = time.monotonic()
        with pytest.raises(Reject) as rejected:
            with tasks._requeue_on_broker_loss():
                client.set("a-batch", "payload")
        assert time.monotonic() - began >= 1.0 and client.ping()  # Redis was back when it rejected
        assert rejected.value.requeue and "broker unreachable" in str(rejected.value.reason)
    finally:
        client.close()
        server.stop()


def test_pool_child_killed_mid_batch(redis_url, demo_corpus, tmp_path):
    """`worker --concurrency 2` (prefork): a child killed mid-batch is replaced and its batch
    requeued at once (reject on worker lost), without waiting for the visibility timeout."""
    import os
    import signal

    folder = tmp_path / "pool"
    # 20 s: the replacement child's first batch builds the model within the limit (a 10 s limit
    # was exceeded twice on a slow, loaded machine and the batch was marked failed)
    cluster = Cluster(redis_url, folder, time_limit_s=20.0)
    try:
        cluster.start_writer()
        cluster.start_worker("pool", "--concurrency", "2")
        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=4, tag="poolkill")
        sub = _submit(cluster, corpus)
        run_id = cluster.run_id(sub)
        running = key("running", sub.run_key, sub.database_id)
        _wait_for(lambda: cluster.redis.hlen(running) > 0, what="a batch to start")
        worker = json.loads(cluster.redis.hvals(running)[0])["worker"]  # host:pid of the child
        child = int(worker.rsplit(":", 1)[1])
        assert child != cluster.procs["pool"].pid
        os.kill(child, signal.SIGKILL)
        assert cluster.wait_status(sub.name, timeout=150) == "done"
        assert_counted_once(cluster.db, run_id)
        assert "WorkerLostError" in (folder / "pool.log").read_text()
    finally:
        cluster.stop()


def test_a_message_whose_ack_met_redis_away_is_released_all_the_same():
    """kombu's QoS kept a message whose ack failed (Redis restarting as the batch finished):
    counted against the prefetch limit, a solo worker never polled again after Redis was back."""
    from kombu.transport import redis as kombu_redis
    from kombu.transport import virtual

    import headatlas.workers.consumer  # noqa: F401 - applies the release

    class Away:
        do_restore = False

        def _restore_at_beginning(self, message):
            raise redis.exceptions.ConnectionError("Connection refused.")

    qos = virtual.QoS(Away(), prefetch_count=1)
    qos.__class__ = kombu_redis.QoS
    qos._remove_from_indices = lambda tag: (_ for _ in ()).throw(redis.exceptions.ConnectionError("refused"))
    qos.restore_by_tag = lambda tag, leftmost=False: (_ for _ in ()).throw(redis.exceptions.ConnectionError("x"))
    for settle in (lambda tag: qos.ack(tag), lambda tag: qos.reject(tag, requeue=True)):
        virtual.QoS.append(qos, object(), "tag")  # delivered (Redis's own bookkeeping aside)
        assert not qos.can_consume()
        with pytest.raises(redis.exceptions.ConnectionError):
            settle("tag")
        assert qos.can_consume()
