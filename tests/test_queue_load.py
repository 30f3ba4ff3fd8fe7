"""Load: hundreds of small batches through two workers and the writer; nothing lost, every
window once, the writer's memory flat."""

from __future__ import annotations

import time

import pytest
from conftest import invoke_cli
from queue_support import Cluster, assert_counted_once, make_corpus

from headatlas.service.config import Settings
from headatlas.service.params import AnalysisParams
from headatlas.workers.ledger import key

# minutes of work: opt-in (`make test-heavy`), deselected from `make test`
pytestmark = [pytest.mark.integration, pytest.mark.heavy]


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_five_hundred_batches_two_workers(redis_url, demo_corpus, tmp_path):
    from headatlas.workers.submit import submit

    cluster = Cluster(redis_url, tmp_path / "cluster", time_limit_s=30)
    try:
        writer = cluster.start_writer()
        cluster.start_worker("w1")
        cluster.start_worker("w2")
        corpus = make_corpus(tmp_path, demo_corpus, paragraphs=60, tag="load", copies=2)
        settings = Settings(broker_url=redis_url, db=cluster.db)
        sub = submit(
            str(corpus),
            settings=settings,
            model="random:tiny",
            dtype="float32",
            params=AnalysisParams(seq_len=16),
            batch_size=1,
        )
        assert sub.batches >= 500
        run_id = cluster.run_id(sub)
        samples, reads = [], 0
        deadline = time.monotonic() + 900
        while True:
            done = int(cluster.redis.scard(key("done", sub.run_key, sub.database_id)))
            if done >= sub.batches // 5:
                samples.append(_rss_mb(writer.pid))
            if done >= sub.batches:
                break
            assert time.monotonic() < deadline, cluster.logs()
            if 0 < done < sub.batches * 0.8 and reads < 3:
                # readers while the writer is busy: a wait, never a lock error
                for args in (
                    ("status", sub.name),
                    ("sql", "SELECT count(*) AS n FROM run_windows"),
                    ("query", "layers", "--run", sub.name),
                ):
                    result = invoke_cli(*args, env=cluster.env)
                    assert result.returncode == 0, result.stderr
                reads += 1
            time.sleep(1.0)
        assert reads >= 1
        assert cluster.wait_status(sub.name, timeout=120) == "done"
        assert_counted_once(cluster.db, run_id)
        # after warm-up the writer does not grow with the number of batches it has stored
        assert samples[-1] - samples[0] < 40, samples
    finally:
        cluster.stop()
