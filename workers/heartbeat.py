"""Lost workers noticed in seconds: a heartbeat from a batch's delivery to its end, and the
sweep that requeues a batch whose heartbeat stopped.

From the moment a batch reaches a worker process until it starts, the process's beacon
(``WorkerBeacon``, one per consuming process) keeps its delivery claimed (``Ledger.deliver``):
a prefetched message, a retry waiting for its countdown, a prefork pool whose children are busy
or still starting. Once started, the process running it refreshes the batch's own heartbeat from
a thread (``BatchHeartbeat``). A process killed with SIGKILL, by the out-of-memory killer or
with its node stops refreshing either; once silent for ``SILENT_S`` the writer's sweep
(``requeue_lost``) moves the batch to lost and puts its unacknowledged message back at the head
of the analysis queue, whatever the task time limit. Late acknowledgement and the visibility
timeout stay as the second line of defence (no writer running).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass

import redis

from headatlas.workers.ledger import WORKERS, Ledger, Running
from headatlas.workers.policy import DELIVERY_GRACE_S, HEARTBEAT_S, SILENT_S

log = logging.getLogger("headatlas.heartbeat")


class WorkerBeacon:
    """Says in Redis that this worker process consumes the analysis queue, while it does:
    refreshed every HEARTBEAT_S from a thread, only while ``consuming()`` (the Celery consumer
    is connected and running); `status` counts the live ones and says when there are none, and
    the batches delivered to the process and not started yet live as long as it does."""

    def __init__(self, client: redis.Redis, name: str, info: dict, consuming=lambda: True):
        self.r, self.name, self.info, self.consuming = client, name, info, consuming
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="worker-beacon", daemon=True)

    def start(self) -> WorkerBeacon:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self.r.delete(WORKERS + self.name)
        except redis.RedisError:
            pass

    def _beat(self) -> None:
        while True:
            try:
                if self.consuming():
                    self.r.set(WORKERS + self.name, json.dumps(self.info), ex=max(1, round(SILENT_S)))
            except redis.RedisError:
                pass  # Redis away: the key expires, as it should
            except Exception:  # noqa: BLE001 - the beacon must not die of a consumer's state
                log.debug("worker beacon", exc_info=True)
            if self._stop.wait(HEARTBEAT_S):
                return


def live_workers(client: redis.Redis) -> list[str]:
    """host:pid of every worker process whose beacon lives."""
    return sorted(
        k.decode()[len(WORKERS) :] if isinstance(k, bytes) else k[len(WORKERS) :]
        for k in client.scan_iter(match=WORKERS + "*", count=1000)
    )


class BatchHeartbeat:
    """``with BatchHeartbeat(ledger, run_key, batch_id, worker):`` keeps the batch alive."""

    def __init__(self, ledger: Ledger, run_key: str, batch_id: int, worker: str):
        self.ledger, self.run_key, self.batch_id, self.worker = ledger, run_key, batch_id, worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{batch_id}", daemon=True)

    def __enter__(self) -> BatchHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self.ledger.beat(self.run_key, self.batch_id, self.worker, SILENT_S):
                    return  # declared lost and requeued (we were silent too long): another worker has it
            except redis.RedisError as exc:  # Redis away: the task's own error handling decides
                log.warning("heartbeat of batch %s: %s", self.batch_id, exc)


@dataclass
class LostBatch:
    run_key: str
    entry: Running
    requeued: bool  # False: the message was no longer unacknowledged (a pool requeued it already)


def requeue_lost(ledger: Ledger, broker_url: str, transport_options: dict) -> list[LostBatch]:
    """Every batch of this database's active runs whose heartbeat stopped, running or delivered
    and not started: declared lost (once, atomically) and its message put back at the head of the
    analysis queue."""
    lost = []
    for run_key in ledger.active_runs():
        for entry in [*ledger.silent(run_key), *ledger.unclaimed(run_key, DELIVERY_GRACE_S)]:
            if ledger.declare_lost(run_key, entry):
                requeued = restore_message(broker_url, transport_options, entry.task_id, entry.beat)
                lost.append(LostBatch(run_key, entry, requeued))
    return lost


def restore_message(broker_url: str, transport_options: dict, task_id: str, last_beat: float) -> bool:
    """Put the unacknowledged message of ``task_id`` back at the head of its queue, next to be
    taken (kombu's own restore, as its visibility-timeout sweep does; kombu publishes on the
    left and takes from the right). False when it is not unacknowledged, or was delivered
    again after ``last_beat`` (a prefork pool requeued it and a live process holds it now)."""
    from kombu import Connection

    with Connection(broker_url, transport_options=transport_options) as conn:
        channel = conn.default_channel
        for tag, raw in channel.client.hgetall(channel.unacked_key).items():
            message = json.loads(raw)[0]
            if message.get("headers", {}).get("id") != task_id:
                continue
            delivered = channel.client.zscore(channel.unacked_index_key, tag)
            if delivered is not None and delivered > last_beat:
                return False
            channel.qos.restore_by_tag(tag.decode() if isinstance(tag, bytes) else tag, leftmost=False)
            return True
    return False
