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
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from headatlas.workers.ledger import GONE, REDELIVERED, RESTORE_PENDING, RESTORED, WORKERS, Ledger
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
    """A lost batch the sweep acted on: declared lost now, or (``retried``) lost at an earlier
    sweep whose try to put its message back failed."""

    run_key: str
    batch_id: int
    worker: str  # host:pid
    beat: float  # its last heartbeat (epoch s)
    restore: str  # ledger.RESTORES: what became of its message
    tries: int  # tries to put it back so far
    retried: bool = False
    error: str = ""  # why the last try failed (restore "pending")

    @property
    def requeued(self) -> bool:
        """Its message put back at the head of the queue by this sweep."""
        return self.restore == RESTORED

    def outcome(self) -> str:
        if self.restore == RESTORE_PENDING:
            times = "time" if self.tries == 1 else "times"
            return f"its message not yet put back: tried {self.tries} {times} ({self.error}); trying again"
        if self.restore == RESTORED:
            return f"requeued (after {self.tries} tries)" if self.tries > 1 else "requeued"
        return "its pool had requeued it"  # delivered again, or no longer unacknowledged


def requeue_lost(ledger: Ledger, broker_url: str, transport_options: dict) -> list[LostBatch]:
    """Every batch of this database's active runs whose heartbeat stopped, running or delivered
    and not started: declared lost (once, atomically) and its message put back at the head of the
    analysis queue. A try that fails (the broker erring or slow at that instant) leaves the lost
    record "pending", and each sweep tries again, first, until the message is put back, delivered
    again, gone, or the batch stored; a failure ends the sweep's tries (the rest wait for the next)."""
    lost: list[LostBatch] = []
    for run_key in ledger.active_runs():
        for batch_id, raw, record, retried in _due(ledger, run_key):
            lost.append(
                _restore(ledger, run_key, batch_id, raw, record, broker_url, transport_options, retried=retried)
            )
            if lost[-1].restore == RESTORE_PENDING:
                return lost
    return lost


def _due(ledger: Ledger, run_key: str) -> Iterator[tuple[int, str, dict, bool]]:
    """The lost batches of ``run_key`` whose message is to be put back: (batch id, its lost record as
    stored and read, whether an earlier sweep tried), those still pending first, then each silent
    batch as it is declared lost (none is declared once the caller stops taking them)."""
    for batch_id, raw, record in ledger.pending_restores(run_key):
        yield batch_id, raw, record, True
    for entry in [*ledger.silent(run_key), *ledger.unclaimed(run_key, DELIVERY_GRACE_S)]:
        declared = ledger.declare_lost(run_key, entry)
        if declared is not None:
            yield entry.batch_id, declared, json.loads(declared), False


def _restore(
    ledger: Ledger,
    run_key: str,
    batch_id: int,
    raw: str,
    record: dict,
    broker_url: str,
    transport_options: dict,
    *,
    retried: bool = False,
) -> LostBatch:
    """One try to put a lost batch's message back, its outcome kept in its lost record."""
    from kombu.exceptions import KombuError

    error = ""
    try:
        outcome = restore_message(broker_url, transport_options, record["task"], float(record["beat"]))
    except (KombuError, redis.RedisError, OSError) as exc:
        outcome, error = RESTORE_PENDING, f"{type(exc).__name__}: {exc}"
    tries = int(record.get("tries", 0)) + 1
    ledger.record_restore(run_key, batch_id, raw, outcome, tries)  # False: stored or lost again meanwhile
    return LostBatch(run_key, batch_id, record["worker"], float(record["beat"]), outcome, tries, retried, error)


def restore_message(broker_url: str, transport_options: dict, task_id: str, last_beat: float) -> str:
    """Put the unacknowledged message of ``task_id`` back at the head of its queue, next to be
    taken (kombu's own restore, as its visibility-timeout sweep does; kombu publishes on the
    left and takes from the right): RESTORED; REDELIVERED when it was delivered again after
    ``last_beat`` (a prefork pool requeued it and a live process holds it now); GONE when it is
    not unacknowledged. Raises when the broker fails: at once, without kombu's own retries (the
    next sweep tries again; this one must not hold up the writer's lease)."""
    from kombu import Connection

    with Connection(broker_url, transport_options={**transport_options, "max_retries": 0}) as conn:
        channel = conn.default_channel
        for tag, raw in channel.client.hgetall(channel.unacked_key).items():
            message = json.loads(raw)[0]
            if message.get("headers", {}).get("id") != task_id:
                continue
            delivered = channel.client.zscore(channel.unacked_index_key, tag)
            if delivered is not None and delivered > last_beat:
                return REDELIVERED
            channel.qos.restore_by_tag(tag.decode() if isinstance(tag, bytes) else tag, leftmost=False)
            return RESTORED
    return GONE
