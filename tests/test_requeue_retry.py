"""The lost-worker sweep puts a lost batch's message back even when its first try fails.

A batch is declared lost (out of the running list) before its unacknowledged message is put back
at the head of the analysis queue; a restore that fails at that instant must be tried again by
the next sweeps, and `status` must say "requeued" only once it happened. Real Redis (the suite's
own), a real kombu message left unacknowledged as a killed worker leaves it.
"""

from __future__ import annotations

import json
import socket

import pytest
import redis

from headatlas.service.config import Settings
from headatlas.workers.app import ANALYSIS_QUEUE, broker_options, make_app, send_batch
from headatlas.workers.heartbeat import requeue_lost
from headatlas.workers.ledger import Ledger
from headatlas.workers.status import LostInfo

RUN_KEY = "r" * 64
WORKER = "gone-host:4242"


def _closed_port_url() -> str:
    """A Redis URL nothing answers at (the broker refusing connections at that instant)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def _unacked_ids(client: redis.Redis) -> list[str]:
    return [json.loads(raw)[0]["headers"]["id"] for raw in client.hgetall("unacked").values()]


def _queued_ids(client: redis.Redis) -> list[str]:
    return [json.loads(raw)["headers"]["id"] for raw in client.lrange(ANALYSIS_QUEUE, 0, -1)]


@pytest.fixture()
def lost_batch(redis_url):
    """A batch a worker took (its message delivered, unacknowledged) and started, then went
    silent: (ledger, broker options, the batch's task id)."""
    from kombu import Connection

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    settings = Settings.from_env({"HEADATLAS_BROKER_URL": redis_url})
    options = broker_options(settings)
    app = make_app(settings)
    send_batch(app, RUN_KEY, 7, {"windows": []})
    with Connection(redis_url, transport_options=options) as conn:
        channel = conn.default_channel
        message = channel.basic_get(ANALYSIS_QUEUE, no_ack=False)
        assert message is not None
        channel.qos.restore_at_shutdown = False  # a worker killed with SIGKILL gives nothing back
    task_id = message.headers["id"]
    assert _unacked_ids(client) == [task_id] and not client.llen(ANALYSIS_QUEUE)
    ledger = Ledger(client, "db-requeue-retry")
    ledger.start(RUN_KEY, 7, WORKER, task_id, ttl_s=30)
    client.delete(ledger.key("alive", f"{RUN_KEY}:7"))  # its heartbeat expired: the worker is gone
    yield ledger, options, task_id
    client.flushdb()
    client.close()


def test_a_failed_restore_is_tried_again_until_the_message_is_back(redis_url, lost_batch):
    ledger, options, task_id = lost_batch
    r = ledger.r

    # first sweep: the broker refuses the restore at that instant
    first = requeue_lost(ledger, _closed_port_url(), options)
    assert [(b.batch_id, b.requeued) for b in first] == [(7, False)]
    record = ledger.lost(RUN_KEY)[7]
    assert record["restore"] == "pending" and record["tries"] == 1
    assert _unacked_ids(r) == [task_id] and not r.llen(ANALYSIS_QUEUE)  # the message still waits
    assert not ledger.running(RUN_KEY)  # out of the running list: only the lost record remembers it
    info = LostInfo(7, WORKER, 12, record["restore"] == "restored", tries=record["tries"])
    assert "requeued" not in info.describe()
    assert "its message not yet put back: tried 1 time" in info.describe()

    # a second failing sweep counts a second try
    requeue_lost(ledger, _closed_port_url(), options)
    assert ledger.lost(RUN_KEY)[7]["tries"] == 2

    # the next sweep, the broker answering: the message is back at the head of the queue
    again = requeue_lost(ledger, redis_url, options)
    assert [(b.batch_id, b.requeued, b.tries) for b in again] == [(7, True, 3)]
    assert _queued_ids(r) == [task_id] and not r.hlen("unacked")
    record = ledger.lost(RUN_KEY)[7]
    assert record["restore"] == "restored" and record["tries"] == 3
    info = LostInfo(7, WORKER, 12, True, tries=record["tries"])
    assert info.describe().endswith("requeued")

    # nothing left to do: later sweeps neither restore it again nor report it
    assert requeue_lost(ledger, redis_url, options) == []
    assert _queued_ids(r) == [task_id]


def test_a_pending_restore_is_dropped_once_the_batch_is_stored(redis_url, lost_batch):
    ledger, options, task_id = lost_batch
    requeue_lost(ledger, _closed_port_url(), options)
    assert ledger.lost(RUN_KEY)[7]["restore"] == "pending"
    ledger.finished(RUN_KEY, 7, failed=False)  # stored meanwhile (its first run's result reached the writer)
    assert requeue_lost(ledger, redis_url, options) == []
    assert 7 not in ledger.lost(RUN_KEY)  # not brought back by the retry
    assert _unacked_ids(ledger.r) == [task_id] and not ledger.r.llen(ANALYSIS_QUEUE)


@pytest.mark.parametrize("meanwhile", ["redelivered", "gone"])
def test_a_pending_restore_ends_when_the_message_is_delivered_again_or_gone(redis_url, lost_batch, meanwhile):
    ledger, options, task_id = lost_batch
    requeue_lost(ledger, _closed_port_url(), options)
    r = ledger.r
    tag = next(iter(r.hkeys("unacked")))
    if meanwhile == "redelivered":  # after the last heartbeat: a live process holds it now
        r.zadd("unacked_index", {tag: ledger.lost(RUN_KEY)[7]["beat"] + 60})
    else:  # no longer unacknowledged (the visibility timeout put it back, and it ran to its end)
        r.hdel("unacked", tag)
        r.zrem("unacked_index", tag)
    done = requeue_lost(ledger, redis_url, options)
    assert [(b.batch_id, b.requeued, b.restore) for b in done] == [(7, False, meanwhile)]
    assert ledger.lost(RUN_KEY)[7]["restore"] == meanwhile
    assert not r.llen(ANALYSIS_QUEUE)  # nothing put back by the sweep
    assert _unacked_ids(r) == ([task_id] if meanwhile == "redelivered" else [])
    assert requeue_lost(ledger, redis_url, options) == []  # and not tried again
