"""The writer: the one process that writes the database while runs go through the queue.

It consumes the ingest queue (a Redis list of messages from submitters and workers) as a
reliable queue: messages are moved atomically to a processing list, stored, committed, and only
then removed. A writer killed at any point leaves its messages in the processing list; the next
writer puts them back first, and ingest being idempotent (keyed by run and batch), a message
stored twice counts once. Consecutive batch results are stored in one transaction (group
commit): opening and closing the DuckDB file costs more than storing a small batch.

The writer holds the ingest queue by a lease (workers/lease.py): a second writer on the same
broker refuses to start. Messages name the database they are for; one for another database is
dropped (and forgotten in that database's state, so that submitting there again queues it). A
thread keeps the lease alive and requeues the batches of workers whose heartbeat stopped.
"""

from __future__ import annotations

import base64
import json
import logging
import signal
import threading
import time

import numpy as np
import redis
from sqlalchemy.engine import Connection

from headatlas.service.config import Settings
from headatlas.service.engine.results import (
    BatchResult,
)  # numpy only: importing torch here cost seconds inside the first transaction
from headatlas.service.errors import HeadatlasError, StoreBusy, StoreError, WriterConflict
from headatlas.service.storage import queue_store
from headatlas.service.storage.store import Store, ingest_batches, store_probe
from headatlas.workers.heartbeat import requeue_lost
from headatlas.workers.lease import HEARTBEAT_S, WriterLease
from headatlas.workers.ledger import INGEST, PROCESSING, Ledger, connect

log = logging.getLogger("headatlas.writer")

GROUP = 32  # messages per transaction at most (bounds how long a reader may wait)
READER_GAP_S = 0.025  # the file stays closed at least this long between transactions


class Writer:
    def __init__(self, settings: Settings):
        from headatlas.service.storage.db import read_database_id

        self.settings = settings
        client = connect(settings.broker_url, check=False)
        self.lease = WriterLease(client, settings.db, settings.broker_url)
        while True:  # a writer started before Redis (compose brings both up) waits for it
            try:
                self.lease.acquire()  # before touching the file: a refused writer changes nothing
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("broker unreachable (%s); waiting for it", exc)
                time.sleep(1.0)
        try:
            self.store = Store(settings.db)
            self.store.ensure_schema()  # a stale database fails now, not on the first batch
            self.database_id = read_database_id(settings.db)
            self.lease.set_database(self.database_id)
        except BaseException:
            self.lease.release()
            raise
        self.ledger = Ledger(client, self.database_id)
        self.run_ids: dict[str, int] = {}
        self.stopping = False
        self.lost_lease = False
        self._keeper_stop = threading.Event()

    # --- lease and lost workers (a thread: a long transaction must not silence the lease) ------
    def _keep(self) -> None:
        from headatlas.workers.app import broker_options

        options = broker_options(self.settings)
        while not self._keeper_stop.wait(HEARTBEAT_S):
            try:
                if not self.lease.refresh():
                    log.error("another writer took the ingest queue (this one was silent too long); stopping")
                    self.lost_lease = self.stopping = True
                    return
                for lost in requeue_lost(self.ledger, self.settings.broker_url, options):
                    e = lost.entry
                    log.warning(
                        "run %s batch %s: worker %s lost (no heartbeat for %.0f s); %s",
                        lost.run_key,
                        e.batch_id,
                        e.worker,
                        time.time() - e.beat,
                        "requeued" if lost.requeued else "its pool had requeued it",
                    )
            except redis.RedisError as exc:
                log.warning("lease and lost-worker sweep: broker unreachable (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - the sweep must not stop the lease's heartbeat
                log.exception("lost-worker sweep failed; retrying")

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)  # finish the group in hand, then leave
        keeper = threading.Thread(target=self._keep, name="writer-lease", daemon=True)
        keeper.start()
        try:
            self._loop()
        finally:
            self._keeper_stop.set()
            keeper.join(timeout=10)
            if not self.lost_lease:
                self.lease.release()
        if self.lost_lease:
            raise WriterConflict(
                f"another writer took the ingest queue of {self.settings.broker_url}: run one writer per broker"
            )

    def _loop(self) -> None:
        recovered = False
        while not self.stopping:
            try:
                if not recovered:
                    self._recover()
                    recovered = True
                self.step()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("broker unreachable (%s); retrying", exc)
                recovered = False  # what was taken is back in the queue once Redis answers
                time.sleep(1.0)
            except StoreBusy as exc:
                log.warning("%s; retrying", exc)
                recovered = False
                time.sleep(1.0)

    def step(self, timeout_s: float = 1.0) -> int:
        """Take up to GROUP messages, store them, commit, remove them. Returns how many."""
        raw = self._take(timeout_s)
        if not raw:
            return 0
        started = time.monotonic()
        self.handle([json.loads(m) for m in raw])
        self.ledger.r.delete(PROCESSING)
        # With a backlog the writer would reopen the file at once, and readers (status, query,
        # sql), which retry on its lock with backoff, would seldom find it free: it stays
        # closed as long as it was held, so a reader's try succeeds at least every other time.
        time.sleep(max(READER_GAP_S, time.monotonic() - started))
        return len(raw)

    def _stop(self, _signum, _frame) -> None:
        self.stopping = True

    def _recover(self) -> None:
        """Messages a previous writer took but did not finish go back to the head, in order."""
        while self.ledger.r.lmove(PROCESSING, INGEST, "RIGHT", "LEFT"):
            pass

    def _take(self, timeout_s: float) -> list[bytes]:
        # BLMOVE takes a double timeout (seconds, fractions allowed); redis-py annotates it as int
        first = self.ledger.r.blmove(INGEST, PROCESSING, timeout_s, "LEFT", "RIGHT")  # type: ignore[arg-type]
        if first is None:
            return []
        pipe = self.ledger.r.pipeline()
        for _ in range(GROUP - 1):
            pipe.lmove(INGEST, PROCESSING, "LEFT", "RIGHT")
        return [first, *(m for m in pipe.execute() if m is not None)]

    # --- messages -----------------------------------------------------------------------------
    def handle(self, messages: list[dict]) -> None:
        """In order; consecutive batch results and failures share one transaction."""
        group: list[dict] = []
        for msg in messages:
            if msg.get("database_id") != self.database_id:
                self._not_ours(msg)
                continue
            if msg["kind"] in ("ingest", "failed"):
                group.append(msg)
                continue
            self._store_group(group)
            group = []
            if msg["kind"] == "open_run":
                self._open_run(msg["run_key"])
            elif msg["kind"] == "reopen":
                run_id = self._run_id(msg["run_key"])
                if run_id is not None:
                    queue_store.reopen_failed(self.store, run_id)
            elif msg["kind"] == "probe":
                self._store_probe(msg)
        self._store_group(group)

    def _store_probe(self, msg: dict) -> None:
        """A run's synthetic probe (SPEC §8): one transaction; the same probe again is skipped."""
        run_key = msg["run_key"]
        run_id = self.run_ids.get(run_key)
        if run_id is None:  # a finished run (even an embedded one) is found by its key
            with self.store.read() as conn:
                run = queue_store.find_run_by_key(conn, run_key)
            run_id = run.run_id if run is not None else self._run_id(run_key)
        if run_id is None:
            return
        spec = (int(msg["length"]), int(msg["sequences"]), int(msg["seed"]))
        try:
            with self.store.write() as conn:
                store_probe(conn, run_id, spec, {name: np.asarray(v) for name, v in msg["scores"].items()})
        except StoreBusy:
            raise
        except Exception:  # noqa: BLE001 - a probe the database refuses must not stop the writer
            log.exception("run %s: the probe's scores could not be stored", run_key)

    def _not_ours(self, msg: dict) -> None:
        """A message for another database (its writer was replaced): never stored here. Its
        database forgets it was in flight, so submitting there again queues the batch."""
        other = msg.get("database_id")
        log.warning(
            "dropped a %s message of run %s for database %s: this writer stores into %s (database %s)",
            msg["kind"],
            msg.get("run_key"),
            other,
            self.settings.db,
            self.database_id,
        )
        if not other:
            return
        ledger = Ledger(self.ledger.r, other)
        if msg["kind"] in ("ingest", "failed"):
            ledger.forget(msg["run_key"], msg["batch_id"])
        elif msg["kind"] == "open_run":
            ledger.set_run_error(
                msg["run_key"],
                (
                    f"the writer on {self.settings.broker_url} now stores into {self.settings.db} (database "
                    f"{self.database_id[:8]}), not into database {other[:8]}: submit again"
                ),
            )

    def _open_run(self, run_key: str) -> None:
        self.ledger.writer_state("opening", run=run_key)
        try:
            run_id = self._run_id(run_key, refresh=True)
            if run_id is not None:
                with self.store.write() as conn:
                    self.ledger.reconcile_done(run_key, queue_store.stored_batches(conn, run_id))
                    self._publish(conn, run_key, run_id)
        except HeadatlasError as exc:
            self.ledger.set_run_error(run_key, str(exc))  # the submitter is waiting for it
        finally:
            self.ledger.writer_state("idle")

    def _run_id(self, run_key: str, *, refresh: bool = False) -> int | None:
        """The database id of a run, created from the submitter's description on first sight;
        ``refresh`` re-reads the description (the submitter has finished cutting the corpus)."""
        if run_key not in self.run_ids or refresh:
            meta = self.ledger.run_meta(run_key)
            if meta is None:
                log.warning("run %s: no description in Redis (lost?); submit the corpus again", run_key)
                return None
            run, _plan = queue_store.open_run(self.store, meta)
            self.ledger.set_run_id(run_key, run.run_id)
            self.run_ids[run_key] = run.run_id
        return self.run_ids[run_key]

    def _store_group(self, group: list[dict]) -> None:
        if not group:
            return
        known = [(m, run_id) for m in group if (run_id := self._run_id(m["run_key"])) is not None]
        self.ledger.writer_state("ingesting", batches=len(known))
        summaries: dict[str, queue_store.Summary] = {}
        try:
            try:
                with self.store.write() as conn:
                    outcomes = [self._apply(conn, m, run_id) for m, run_id in known]
                    for run_id in {r for _m, r in known}:
                        queue_store.finish_if_complete(conn, run_id)
                    summaries = {m["run_key"]: queue_store.summary(conn, r) for m, r in known}
            except StoreBusy:
                raise  # a reader held the file for long: the messages stay in processing
            except StoreError:
                outcomes = self._one_by_one(known)
            except Exception:  # noqa: BLE001 - a message the database refuses must not stop the writer
                log.exception("a group of %d message(s) failed; storing them one by one", len(known))
                outcomes = self._one_by_one(known)
            if not summaries:
                with self.store.write() as conn:
                    summaries = {m["run_key"]: queue_store.summary(conn, r) for m, r in known}
        finally:
            self.ledger.writer_state("idle")
        pipe = self.ledger.r.pipeline()
        for (msg, _run_id), (failed, windows) in zip(known, outcomes):
            if failed is not None:
                self.ledger.finished(msg["run_key"], msg["batch_id"], failed=failed, windows=windows, pipe=pipe)
        pipe.execute()
        for run_key, summary in summaries.items():
            self._announce(run_key, summary)

    def _publish(self, conn: Connection, run_key: str, run_id: int) -> None:
        self._announce(run_key, queue_store.summary(conn, run_id))

    def _announce(self, run_key: str, summary: queue_store.Summary) -> None:
        """What the database now holds for the run, for `submit --wait` and the sweep."""
        self.ledger.set_run_status(
            run_key, summary.status, done=summary.done, failed=summary.failed, windows=summary.windows
        )
        if summary.status in ("done", "failed") and not self.ledger.in_flight(run_key):
            self.ledger.inactive(run_key)  # nothing of it runs any more: no need to sweep it

    def _one_by_one(self, known):
        """After a group failed: each message in its own transaction, a bad one marked failed."""
        outcomes = []
        for msg, run_id in known:
            try:
                with self.store.write() as conn:
                    outcome = self._apply(conn, msg, run_id)
                    queue_store.finish_if_complete(conn, run_id)
            except StoreBusy:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded on the batch, shown by `headatlas status`
                error = str(exc) if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
                with self.store.write() as conn:
                    changed = queue_store.mark_failed(conn, run_id, msg["batch_id"], attempts=1, error=error)
                    queue_store.finish_if_complete(conn, run_id)
                outcome = (True if changed else None, 0)
            outcomes.append(outcome)
        return outcomes

    def _apply(self, conn: Connection, msg: dict, run_id: int) -> tuple[bool | None, int]:
        """(failed?, windows newly counted); failed is None when nothing changed."""
        if msg["kind"] == "failed":
            changed = queue_store.mark_failed(
                conn, run_id, msg["batch_id"], attempts=msg["attempts"], error=msg["error"]
            )
            return (True if changed else None), 0
        result = BatchResult.from_bytes(base64.b64decode(msg["payload"]))
        try:
            stored = ingest_batches(conn, run_id, [(msg["batch_id"], result)])
        except StoreError as exc:
            # refused before anything was written (windows counted by another batch): the
            # transaction goes on; retrying cannot help
            changed = queue_store.mark_failed(conn, run_id, msg["batch_id"], attempts=1, error=str(exc))
            return (True if changed else None), 0
        return False, len(result.window_ids) if stored else 0
