"""The writer: the one process that writes the database while runs go through the queue.

It consumes the ingest queue (a Redis list of messages from submitters and workers,
workers/messages.py) as a reliable queue: messages are moved atomically to a processing list,
stored, committed, and only then removed. A writer killed at any point leaves its messages in the
processing list; the next writer puts them back first, and ingest being idempotent (keyed by run
and batch), a message stored twice counts once. A message it cannot read is logged and parked
(``messages.PARKED``, counted by `headatlas status`), never dropped.

The writer holds the ingest queue by a lease (workers/lease.py): a second writer on the same
broker refuses to start. Messages name the database they are for; one for another database is
dropped (and forgotten in that database's state, so that submitting there again queues it).

This module is the writer's loop and its dispatch of each message to its handler; its parts:
writer_ingest.py (storing groups of batch messages), writer_sweep.py (the thread that keeps the
lease and requeues lost and stranded batches), writer_pause.py (waiting out a database away or a
lake unavailable), writer_store.py (its own database, never another). Its timings are the fault
policy's (workers/policy.py, docs/reliability.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time

import numpy as np
import redis

from headatlas.service.config import Settings
from headatlas.service.errors import (
    HeadatlasError,
    StoreBusy,
    StoreConflict,
    StoreUnavailable,
    WriterConflict,
)
from headatlas.service.storage import queue_store
from headatlas.service.storage.probes import store_probe
from headatlas.service.storage.runs import run_is_there
from headatlas.service.storage.store import Store
from headatlas.workers.lease import WriterLease, broker_epoch
from headatlas.workers.ledger import HELPER_PROCESSING, INGEST, PROCESSING, Ledger, connect
from headatlas.workers.messages import (
    PARKED,
    BatchAnalysed,
    BatchFailed,
    BatchMessage,
    Message,
    OpenRun,
    ProbeScores,
    ReopenFailed,
    SeriesStep,
    Undecodable,
    decode,
    unhandled,
)
from headatlas.workers.policy import (
    AWAY_POLL_S,
    BROKER_RETRY_S,
    BUSY_RETRY_S,
    CONFLICT_RETRY_S,
    FLAP_S,
    GROUP_BYTES_BOUND,
    GROUP_MESSAGES_BOUND,
    PAUSE_FIRST_S,
    READER_GAP_S,
    STRANDED_S,
    TAKE_WAIT_S,
    Stranded,
    bound,
)
from headatlas.workers.writer_ingest import GroupIngest
from headatlas.workers.writer_pause import Pause, Pauses
from headatlas.workers.writer_store import DatabaseAway, OwnStore, file_database_id
from headatlas.workers.writer_sweep import Sweeps, declare_queues, requeue_stranded

__all__ = ["DatabaseAway", "OwnStore", "Writer", "declare_queues", "file_database_id"]

log = logging.getLogger("headatlas.writer")

TAKE_CHUNK = 32  # messages moved per round trip to Redis while a group is taken


def take_group(
    r: redis.Redis,
    source: str,
    dest: str,
    timeout_s: float,
    *,
    max_bytes: int,
    max_messages: int,
) -> list[bytes]:
    """Group commit: wait up to ``timeout_s`` for a message on ``source``, then move the messages
    waiting behind it, in order and atomically each, from ``source`` to ``dest`` until their
    bytes reach ``max_bytes`` or they number ``max_messages`` (workers/policy.py). Never waits
    for more: idle, a group is what waits; with a backlog, a transaction's worth. A round trip
    moves up to TAKE_CHUNK messages, fewer as the bytes near the bound (the messages taken so far
    give their mean size), so a group passes ``max_bytes`` by about one message at most."""
    # BLMOVE takes a double timeout (seconds, fractions allowed); redis-py annotates it as int
    first = r.blmove(source, dest, timeout_s, "LEFT", "RIGHT")  # type: ignore[arg-type]
    if first is None:
        return []
    taken: list[bytes] = [first]  # type: ignore[list-item] # bytes: the ledger's clients do not decode
    size = len(first)
    while size < max_bytes and len(taken) < max_messages:
        mean = size / len(taken)
        chunk = max(1, min(TAKE_CHUNK, max_messages - len(taken), int((max_bytes - size) / mean)))
        pipe = r.pipeline()
        for _ in range(chunk):
            pipe.lmove(source, dest, "LEFT", "RIGHT")
        got = [m for m in pipe.execute() if m is not None]
        taken += got
        size += sum(len(m) for m in got)
        if len(got) < chunk:  # the queue is empty
            break
    return taken


class Writer(GroupIngest, Sweeps, Pauses):
    def __init__(self, settings: Settings):
        from headatlas.service.storage.backends import open_backend
        from headatlas.service.storage.db import read_database_id

        self.settings = settings
        # read as the writer starts (a bad HEADATLAS_BOUND_<NAME> refused in one line, not at import)
        self.group_bytes, self.group_messages = bound(GROUP_BYTES_BOUND), bound(GROUP_MESSAGES_BOUND)
        self.backend = open_backend(settings.db)
        self.db_label = self.backend.label  # what logs and messages show (never a password)
        client = connect(settings.broker_url, check=False)
        self.lease = WriterLease(client, settings.db, settings.broker_url, shared=self.backend.shared_writers)
        while True:  # a writer started before Redis (compose brings both up) waits for it
            try:
                self.lease.acquire()  # before touching the file: a refused writer changes nothing
                self.epoch = broker_epoch(client)
                break
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("broker unreachable (%s); waiting for it", exc)
                time.sleep(BROKER_RETRY_S)
        self._pause: Pause | None = None  # what the writer waits for, while its lake is unavailable
        # when the last pause ended, its last wait, and what it waited for
        self._resumed_at: tuple[float, float, tuple[str, str] | None] = (-FLAP_S, PAUSE_FIRST_S, None)
        try:
            with self.lease.kept():  # waiting, or creating or upgrading the schema, can outlast the lease
                while True:  # a lake whose catalogue is not up yet: wait for it
                    try:
                        self._probe()  # a lake's catalogue answers (else _wait_for_last_database would say "missing")
                        self._wait_for_last_database()  # before anything could create a database
                        Store(self.backend).ensure_schema()  # a stale database fails now, not on the first batch
                        self.database_id = read_database_id(self.backend)
                        break
                    except StoreUnavailable as exc:
                        self._unavailable(exc)
            if self._pause is not None:
                self._resumed()
            self.lease.set_database(self.database_id)
            self.store: Store = OwnStore(self.backend, self.database_id)
        except BaseException:
            self.lease.release()
            raise
        self.ledger = Ledger(client, self.database_id)
        # the messages this writer took and has not committed: a further writer of a lake keeps
        # its own list, which the others put back on the queue when it is gone
        self.processing = f"{HELPER_PROCESSING}{self.lease.token}" if self.lease.helper else PROCESSING
        if self.lease.helper:
            log.warning("another writer stores into this lake too: storing beside it")
        self.run_ids: dict[str, int] = {}
        self.added_effects = {}  # queued measurements of added effects, by key (writer_ingest.AddedEffects)
        self.refused: set[str] = set()
        self.results_due: set[int] = set()
        self.stopping = False
        self.lost_lease = False
        self._keeper_stop = threading.Event()
        self._away: str | None = None  # why the database is away, while it is
        self._stranded: dict[str, Stranded] = {}  # run key: stranded batches as first seen

    def _requeue_stranded(self) -> None:
        """The sweep's stranded batches (``writer_sweep.requeue_stranded``), with the writer's wait."""
        requeue_stranded(self.ledger, self.settings, self._stranded, STRANDED_S)

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
                if self._pause is not None:
                    self._probe()  # still unavailable: raises, and the messages stay queued
                    self._resumed()
                if not recovered:
                    self._recover()
                    recovered = True
                self.step()
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                log.warning("broker unreachable (%s); retrying", exc)
                recovered = False  # what was taken is back in the queue once Redis answers
                time.sleep(BROKER_RETRY_S)
            except StoreUnavailable as exc:  # a lake: its catalogue or data path, for now
                recovered = False  # the taken messages go back to the queue, and are stored again
                self._unavailable(exc)
            except DatabaseAway as exc:
                recovered = False  # the taken messages go back to the queue, and wait there
                self._database_away(str(exc))
                time.sleep(AWAY_POLL_S)
                continue
            except StoreConflict as exc:  # a lake: another writer committed the same rows first
                log.info("%s", exc)
                recovered = False  # the messages go back to the queue, and are stored (or skipped) again
                time.sleep(CONFLICT_RETRY_S)
            except StoreBusy as exc:
                log.warning("%s; retrying", exc)
                recovered = False
                time.sleep(BUSY_RETRY_S)
            if self._away is not None and recovered:
                log.warning("database %s is back; storing again", self.db_label)
                self._away = None

    def step(self, timeout_s: float = TAKE_WAIT_S) -> int:
        """Take the waiting messages (``take_group``), store them, commit, remove them. Returns how many."""
        if isinstance(self.store, OwnStore):
            self.store.check()  # a database away: take nothing
        raw = self._take(timeout_s)
        if not raw:
            self._store_results_due()  # idle: an ended run's results, one per idle turn
            return 0
        started, self.outside_s = time.monotonic(), 0.0
        self.handle(self._readable(raw))
        self.ledger.r.delete(self.processing)
        # With a backlog the writer would reopen the file at once, and readers (status, query,
        # sql), which retry on its lock with backoff, would seldom find it free: it stays
        # closed as long as it was held, so a reader's try succeeds at least every other time
        # (the payloads' decoding, done before the file is opened, is not counted)
        time.sleep(max(READER_GAP_S, time.monotonic() - started - self.outside_s))
        return len(raw)

    def _stop(self, _signum, _frame) -> None:
        self.stopping = True

    def _recover(self) -> None:
        """Messages a previous writer took but did not finish go back to the head, in order."""
        while self.ledger.r.lmove(self.processing, INGEST, "RIGHT", "LEFT"):
            pass

    def _take(self, timeout_s: float) -> list[bytes]:
        return take_group(
            self.ledger.r,
            INGEST,
            self.processing,
            timeout_s,
            max_bytes=self.group_bytes,
            max_messages=self.group_messages,
        )

    # --- messages -----------------------------------------------------------------------------
    def _readable(self, raw: list[bytes]) -> list[Message]:
        """The messages taken, in order; one that does not decode is parked (``_park``)."""
        out: list[Message] = []
        for item in raw:
            try:
                out.append(decode(item))
            except Undecodable as exc:
                self._park(item, exc.reason)
        return out

    def _park(self, raw: bytes, reason: str) -> None:
        """A message this writer cannot read (another program's, a newer headatlas's, damaged):
        logged, and moved from the processing list to the parked list, with why, for a person to
        look at (`redis-cli LRANGE headatlas:ingest:parked 0 -1`); nothing of it is stored."""
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        log.error(
            "a message on the ingest queue is not one this writer reads (%s): parked in %s, nothing of it stored: %.300s",
            reason,
            PARKED,
            text,
        )
        record = {"reason": reason, "at": time.time(), "writer": f"{socket.gethostname()}:{os.getpid()}", "raw": text}
        pipe = self.ledger.r.pipeline()
        pipe.rpush(PARKED, json.dumps(record))
        pipe.lrem(self.processing, 1, raw)  # type: ignore[arg-type] # redis-py takes bytes, annotated str
        pipe.execute()

    def handle(self, messages: list[Message]) -> None:
        """In order; consecutive batch results and failures share one transaction."""
        group: list[BatchMessage] = []
        for msg in messages:
            if msg.database_id != self.database_id:
                self._not_ours(msg)
                continue
            if isinstance(msg, (BatchAnalysed, BatchFailed)):
                group.append(msg)
                continue
            self._store_group(group)
            group = []
            if isinstance(msg, OpenRun):
                self._open_run(msg.run_key)
            elif isinstance(msg, ReopenFailed):
                run_id = self._run_id(msg.run_key)
                if run_id is not None:
                    queue_store.reopen_failed(self.store, run_id)
            elif isinstance(msg, ProbeScores):
                self._store_probe(msg)
            elif isinstance(msg, SeriesStep):
                self._series_step(msg)
            else:
                unhandled(msg)  # mypy refuses a message type without a branch
        self._store_group(group)

    def _store_probe(self, msg: ProbeScores) -> None:
        """A run's synthetic probe (SPEC §8): one transaction; the same probe again is skipped."""
        run_key = msg.run_key
        run_id = self.run_ids.get(run_key)
        if run_id is None:  # a finished run (even an embedded one) is found by its key
            with self.store.read() as conn:
                run = queue_store.find_run_by_key(conn, run_key)
            run_id = run.run_id if run is not None else self._run_id(run_key)
        if run_id is None:
            return
        spec = (msg.length, msg.sequences, msg.seed)
        try:
            with self.store.write() as conn:
                if run_is_there(conn, run_id, run_key):  # not a run deleted meanwhile
                    store_probe(conn, run_id, spec, {name: np.asarray(v) for name, v in msg.scores.items()})
        except StoreBusy:
            raise
        except Exception:  # noqa: BLE001 - a probe the database refuses must not stop the writer
            log.exception("run %s: the probe's scores could not be stored", run_key)

    def _series_step(self, msg: SeriesStep) -> None:
        """A finished run submitted again as a checkpoint of a series: recorded in it, in one
        transaction (a run deleted meanwhile is not)."""
        series = {"name": msg.series, "checkpoints": msg.checkpoints, "step": msg.step, "checkpoint": msg.checkpoint}
        with self.store.write() as conn:
            run = queue_store.find_run_by_key(conn, msg.run_key)
            if run is not None:
                queue_store.add_series_step(conn, run.run_id, series)

    def _not_ours(self, msg: Message) -> None:
        """A message for another database (its writer was replaced): never stored here. Its
        database forgets it was in flight, so submitting there again queues the batch."""
        other = msg.database_id
        log.warning(
            "dropped a %s message of run %s for database %s: this writer stores into %s (database %s)",
            msg.kind,
            msg.run_key,
            other,
            self.db_label,
            self.database_id,
        )
        if not other:
            return
        ledger = Ledger(self.ledger.r, other)
        if isinstance(msg, (BatchAnalysed, BatchFailed)):
            ledger.forget(msg.run_key, msg.batch_id)
        elif isinstance(msg, OpenRun):
            ledger.set_run_error(
                msg.run_key,
                (
                    f"the writer on {self.settings.broker_url} now stores into {self.db_label} (database "
                    f"{self.database_id[:8]}), not into database {other[:8]}: submit again"
                ),
            )

    def _open_run(self, run_key: str) -> None:
        self.ledger.writer_state("opening", run=run_key)
        try:
            run_id = self._run_id(run_key, refresh=True)
            if run_id is not None:
                # what the database holds, read in one transaction; Redis is told after it ends: a
                # broker that stalls (writes paused, a slow disk) must not keep the file from the
                # beat's claims and the command line's reads meanwhile
                with self.store.write() as conn:
                    # `runs delete` may have come since
                    there = run_is_there(conn, run_id, self._stored_key(run_key))
                    if there:
                        stored, summary = queue_store.stored_batches(conn, run_id), self._summary(conn, run_key, run_id)
                        added = self.added_effects.get(run_key)
                        if added is not None:  # a measurement of added effects: its own batches
                            stored &= added.batches
                if there:
                    self.ledger.reconcile_done(run_key, stored)
                    self._announce(run_key, summary)
                else:
                    self._run_gone(run_key, run_id)
        except StoreBusy:
            raise  # busy or away: the message stays, and is handled when the file is back
        except HeadatlasError as exc:
            self.ledger.set_run_error(run_key, str(exc))  # the submitter is waiting for it
        finally:
            self.ledger.writer_state("idle")
