"""The writer's sweep: a thread that keeps the writer's lease alive and, every HEARTBEAT_S,
puts back what faults left behind: batches of workers whose heartbeat stopped, batches no message
carries any more, the messages of a lake's writer that is gone, and (Redis having lost its data)
the analysis queue and what the database knows of the runs in flight. A long transaction of the
writer's loop never silences the lease.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from sqlalchemy import text

from headatlas.service.config import Settings
from headatlas.service.errors import HeadatlasError
from headatlas.service.statuses import ENDED, sql
from headatlas.service.storage import queue_store
from headatlas.service.storage.store import Store
from headatlas.workers.heartbeat import requeue_lost
from headatlas.workers.lease import HELPER, WriterLease, broker_epoch, holder
from headatlas.workers.ledger import (
    HELPER_PROCESSING,
    INGEST,
    PROCESSING,
    RESTORE_PENDING,
    Ledger,
    processing_lists,
)
from headatlas.workers.policy import HEARTBEAT_S, Stranded, stranded_long_enough

log = logging.getLogger("headatlas.writer")


class Sweeps:
    """The writer's sweep (a part of ``Writer``: its thread runs ``_keep``)."""

    settings: Settings
    db_label: str
    lease: WriterLease
    ledger: Ledger
    store: Store
    epoch: str
    stopping: bool
    lost_lease: bool
    _keeper_stop: threading.Event

    def _requeue_stranded(self) -> None:
        raise NotImplementedError  # the writer's, with its wait (writer.py)

    def _announce(self, run_key: str, summary: queue_store.Summary) -> None:
        raise NotImplementedError  # the writer's ingest (writer_ingest.py)

    def _keep(self) -> None:
        from headatlas.workers.app import broker_options

        options = broker_options(self.settings)
        while not self._keeper_stop.wait(HEARTBEAT_S):
            try:
                if not self.lease.refresh() and not self._reclaim():
                    self.lost_lease = self.stopping = True
                    return
                self._sweep_writers()
                epoch = broker_epoch(self.ledger.r)
                if epoch != self.epoch and self._broker_reset():
                    self.epoch = epoch
                for lost in requeue_lost(self.ledger, self.settings.broker_url, options):
                    # a try that failed again is news only at the first sweep; its outcome always is
                    again = lost.retried and lost.restore == RESTORE_PENDING
                    log.log(
                        logging.INFO if again else logging.WARNING,
                        "run %s batch %s: worker %s lost (no heartbeat for %.0f s); %s",
                        lost.run_key,
                        lost.batch_id,
                        lost.worker,
                        time.time() - lost.beat,
                        lost.outcome(),
                    )
                self._requeue_stranded()
            except redis.RedisError as exc:
                log.warning("lease and lost-worker sweep: broker unreachable (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - the sweep must not stop the lease's heartbeat
                log.exception("lost-worker sweep failed; retrying")

    def _sweep_writers(self) -> None:
        """A lake's writers: the messages of a writer that is gone go back on the queue (the
        batches it had committed are skipped when they come again), and a further writer takes
        the lease of a first writer that is gone."""
        if not self.lease.shared:
            return
        r = self.ledger.r
        for name in processing_lists(r)[1:]:
            token = name[len(HELPER_PROCESSING) :]
            if token != self.lease.token and not r.exists(f"{HELPER}{token}"):
                moved = 0
                while r.lmove(name, INGEST, "RIGHT", "LEFT"):
                    moved += 1
                if moved:
                    log.warning("a writer of this lake is gone: %d message(s) it had taken are queued again", moved)
        if self.lease.helper and holder(r)[0] is None and self.lease.take_over():
            moved = 0
            while r.lmove(PROCESSING, INGEST, "RIGHT", "LEFT"):
                moved += 1
            log.warning("the first writer of this lake is gone: holding its lease; %d message(s) queued again", moved)

    def _reclaim(self) -> bool:
        """The lease is no longer ours: taken by another writer (stop), or gone (it expired
        while Redis was away, or Redis lost its data: take it again)."""
        other, _raw = holder(self.lease.r)
        why = self.lease.why_vanished()  # before reclaim, which counts as a refresh
        if other is None and self.lease.reclaim():
            log.warning("the ingest queue's lease had vanished (%s); holding it again", why)
            return True
        log.error(
            "another writer took the ingest queue (%s) while this one was silent; stopping",
            other.describe() if other else "unknown",
        )
        return False

    def _broker_reset(self) -> bool:
        """Redis lost its data: declare the analysis queue again and put back what the database
        knows of its queued runs in flight (stored batches, status); the batches that were
        queued, running or analysed are gone with Redis and must be submitted again (a waiting
        `submit --wait` does it by itself). False when the database could not be read now."""
        log.warning("Redis lost its data (restarted without persistence?): queues and live run state are gone")
        declare_queues(self.settings)
        try:
            with self.store.read() as conn:
                rows = conn.execute(
                    text(
                        "SELECT run_id, run_key, name FROM runs WHERE engine = 'queue' "
                        f"AND status NOT IN {sql(*ENDED)} ORDER BY run_id"
                    )
                ).all()
                states = [
                    (run_id, run_key, name, queue_store.stored_batches(conn, run_id), queue_store.plan_of(conn, run_id))
                    for run_id, run_key, name in rows
                ]
                summaries = {run_key: queue_store.summary(conn, run_id) for run_id, run_key, _n in rows}
        except HeadatlasError as exc:
            log.warning("cannot read %s to re-declare the runs in flight (%s); trying again", self.db_label, exc)
            return False
        for run_id, run_key, name, done, plan in states:
            self.ledger.reconcile_done(run_key, done)
            self.ledger.set_run_id(run_key, run_id)
            self.ledger.mark_broker_lost(run_key)
            self._announce(run_key, summaries[run_key])
            self.ledger.r.sadd(self.ledger.key("active", "runs"), run_key)
            missing = (plan.batches - len(done)) if plan and plan.batches is not None else None
            log.warning(
                "run %s (%s): %s batch(es) not stored were lost with Redis: submit the same corpus again to queue "
                "them (a waiting `submit --wait` does so by itself)",
                run_id,
                name,
                "?" if missing is None else missing,
            )
        return True


def requeue_stranded(ledger: Ledger, settings: Settings, stranded: dict[str, Stranded], wait_s: float) -> None:
    """Batches in flight that no message carries any more (Redis shut down between a worker's
    pop of a message and its record of it, ``Ledger.stranded``) are queued again from the copies
    that `submit` kept, once they stay so for ``wait_s`` with nothing stored meanwhile: the run
    would otherwise never end. A batch analysed twice is stored once. ``stranded``: what was seen
    stranded at the last look, by run key (updated)."""
    from headatlas.workers.app import ANALYSIS_QUEUE, make_app, send_batch

    now = time.monotonic()
    for run_key in ledger.active_runs():
        lost = ledger.stranded(run_key, ANALYSIS_QUEUE)
        done = len(ledger.done(run_key)) if lost else 0
        seen, now_due = stranded_long_enough(stranded.get(run_key), lost, done, now, wait_s)
        if seen is None:
            stranded.pop(run_key, None)
        else:
            stranded[run_key] = seen
        if not now_due:
            continue
        copies = ledger.copies(run_key, lost)
        app = make_app(settings)
        with app.producer_or_acquire() as producer:
            for batch_id, payload in copies.items():
                send_batch(app, run_key, batch_id, payload, producer)
        log.warning(
            "run %s: batch(es) %s were in no queue and with no worker (their messages were lost as Redis went "
            "down): %s",
            run_key[:12],
            ", ".join(map(str, sorted(lost))),
            "queued again from their kept copies"
            if len(copies) == len(lost)
            else f"{len(copies)} queued again from kept copies; submit the corpus again for the rest",
        )


def declare_queues(settings: Settings) -> None:
    """Declare the analysis queue (its exchange binding lives in Redis, and a Redis that lost
    its data has none: a task sent before a worker re-declared it would have no route)."""
    from headatlas.workers.app import make_app

    app = make_app(settings)
    try:
        with app.connection_for_write() as conn:
            for queue in app.conf.task_queues:
                queue(conn.default_channel).declare()
    except Exception as exc:  # noqa: BLE001 - workers and submitters declare it too
        log.warning("could not declare the analysis queue (%s)", exc)
