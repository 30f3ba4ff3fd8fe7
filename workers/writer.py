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

Faults it rides out (docs/reliability.md): Redis away or restarted (it waits, takes its lease
again when it expired meanwhile, and when Redis lost its data re-declares the analysis queue and
what the database says of the runs in flight); its database file moved, deleted or replaced (it
never creates a database once started: it pauses, says so, and keeps every analysed batch in
Redis until the file it opened is back); a lake's catalogue connection lost (PostgreSQL
restarted, down at start, the session ended by the server) or its data path full or read-only
(it pauses, says what it waits for in its log and to `headatlas status`, tries again with
backoff, and goes on when the fault clears; the messages in hand go back to the queue, and a
batch stored twice counts once).
"""

from __future__ import annotations

import base64
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import redis
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.config import Settings
from headatlas.service.engine.results import (
    BatchResult,
)  # numpy only: importing torch here cost seconds inside the first transaction
from headatlas.service.errors import (
    HeadatlasError,
    StoreBusy,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    WriterConflict,
)
from headatlas.service.storage import queue_store
from headatlas.service.storage.store import (
    Store,
    ingest_batch_ids,
    ingest_batches,
    reserve_batches,
    run_is_there,
    store_probe,
)
from headatlas.workers.heartbeat import requeue_lost
from headatlas.workers.lease import HEARTBEAT_S, HELPER, SILENT_S, WriterLease, broker_epoch, holder
from headatlas.workers.ledger import (
    HELPER_PROCESSING,
    INGEST,
    PROCESSING,
    Ledger,
    Stranded,
    connect,
    deleted_message,
    processing_lists,
    stranded_long_enough,
)

log = logging.getLogger("headatlas.writer")

GROUP = 32  # messages per transaction at most (bounds how long a reader may wait)
READER_GAP_S = 0.025  # the file stays closed at least this long between transactions
AWAY_POLL_S = 2.0  # how often a writer whose database is away looks for it again
PAUSE_FIRST_S = 0.5  # a writer whose lake is unavailable tries again after this, …
PAUSE_MAX_S = 5.0  # … doubling up to this
FLAP_S = 30.0  # a pause this soon after the last one ended goes on with its wait (no new backoff)
ORPHANS = "orphans"  # Ledger key (+ "lake"): uncatalogued data files the writer saw after a data-path fault


@dataclass
class Pause:
    """The writer waits for its lake (``StoreUnavailable.waits_for``) since ``since``."""

    waits_for: str
    cause: str
    since: float  # time.monotonic()
    wall: float  # time.time(), for status
    delay: float = PAUSE_FIRST_S
    tries: int = 0
    data_path: bool = False  # a write failed on the data path during the pause: look for orphans


class DatabaseAway(StoreBusy):
    """The writer's database file is missing, or the file at its path is another database: the
    writer waits for its own (messages stay in Redis, as for a busy file)."""


def file_database_id(path) -> str | None:
    """The id of the headatlas database ``path`` (a path, a ``ducklake:…`` URL or a backend);
    None when there is none, or it holds no headatlas database (empty, another tool's,
    unreadable). Reads only; never creates."""
    from headatlas.service.storage import db
    from headatlas.service.storage.backends import open_backend

    backend = open_backend(path)
    try:
        if not backend.exists():
            return None
        with db.transaction(backend, read_only=True, create=False) as conn:
            return _id_in(conn)
    except HeadatlasError:
        return None


def _id_in(conn: Connection) -> str | None:
    has = conn.execute(
        text("SELECT count(*) FROM information_schema.tables WHERE table_name = 'database_info'")
    ).scalar()
    if not has:
        return None
    return conn.execute(text("SELECT value FROM database_info WHERE key = 'database_id'")).scalar()


class OwnStore(Store):
    """The writer's database: only the file it opened at start, never a new one. A transaction
    on a missing file, or on a file that now holds another database (moved, deleted, replaced
    under the writer), raises DatabaseAway before anything is written."""

    def __init__(self, path, database_id: str):
        super().__init__(path)
        self.database_id = database_id
        self._files = self.backend.identity() is not None  # a lake has no file to move away
        self._ident = self._stat()

    def _stat(self):
        return self.backend.identity()

    def check(self) -> None:
        if not self._files:
            return
        ident = self._stat()
        if ident is None:
            raise DatabaseAway(self._away("missing (moved or deleted)"))
        if ident != self._ident:  # another file at the path: the same database put back, or not
            found = file_database_id(self.backend)
            if found != self.database_id:
                raise DatabaseAway(
                    self._away(f"now {'database ' + found[:8] if found else 'not a headatlas database'}")
                )
            self._ident = ident

    def _away(self, what: str) -> str:
        return (
            f"database {self.backend.label} is {what}: this writer stores into database {self.database_id[:8]} and never "
            "creates another one while runs are in flight; analysed batches wait in Redis until that database "
            f"is back at {self.backend.label}"
        )

    @contextmanager
    def _guarded(self) -> Iterator[Connection]:
        from headatlas.service.storage import db

        self.check()
        try:
            with db.transaction(self.backend, create=False) as conn:
                found = _id_in(conn)
                if found != self.database_id:
                    raise DatabaseAway(self._away(f"now {'database ' + found[:8] if found else 'another file'}"))
                yield conn
        except DatabaseAway:
            raise
        except StoreBusy:
            raise  # busy, or a lake's commit conflict: tried again
        except StoreError:
            if self._files and self._stat() != self._ident:  # the file went away while it was being opened
                raise DatabaseAway(self._away("missing (moved or deleted)")) from None
            raise

    def write(self):
        return self._guarded()

    def atomically(self, work):
        """As Store's, through the guard: a run opened or a group stored just after the file was
        moved away must not create an empty database at its path (seen: `open_run` did, and failed
        on the missing tables, while the writer never paused)."""
        from headatlas.service.storage import db

        return db.atomically(self.backend, work, session=self._guarded)


STRANDED_S = 5.0  # a batch seen stranded this long, with no batch stored meanwhile, is queued again


class Writer:
    def __init__(self, settings: Settings):
        from headatlas.service.storage.backends import open_backend
        from headatlas.service.storage.db import read_database_id

        self.settings = settings
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
                time.sleep(1.0)
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
        self.stopping = False
        self.lost_lease = False
        self._keeper_stop = threading.Event()
        self._away: str | None = None  # why the database is away, while it is
        self._stranded: dict[str, Stranded] = {}  # run key: stranded batches as first seen

    def _wait_for_last_database(self) -> None:
        """The last writer on this broker stored into this path, and messages or runs of its
        database are still in flight, but the file is missing or another database: wait for it
        instead of creating a new database (which would drop every analysed batch)."""
        last = self.lease.last()
        if not last or last.get("db") != self.lease.db or not last.get("database_id"):
            return
        wanted, said = last["database_id"], False
        while True:
            found = file_database_id(self.backend)
            waiting = _messages_for(self.lease.r, wanted)
            runs = Ledger(self.lease.r, wanted).active_runs()
            if found == wanted or not (waiting or runs):
                if said:
                    log.warning("database %s is back; storing", self.db_label)
                return
            if not said:
                what = (
                    "missing"
                    if not self.backend.exists()
                    else f"database {found[:8]}"
                    if found
                    else "not that database"
                )
                log.error(
                    "the last writer on this broker stored into %s (database %s), which %d message(s) and %d run(s) in "
                    "flight are for, but that file is now %s: waiting for it to come back instead of creating a new "
                    "database (nothing is dropped). To give those runs up and start afresh here, delete the Redis key "
                    "headatlas:writer:last",
                    self.db_label,
                    wanted[:8],
                    waiting,
                    len(runs),
                    what,
                )
                said = True
            self.lease.refresh()
            time.sleep(AWAY_POLL_S)

    # --- lease and lost workers (a thread: a long transaction must not silence the lease) ------
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
                    e = lost.entry
                    log.warning(
                        "run %s batch %s: worker %s lost (no heartbeat for %.0f s); %s",
                        lost.run_key,
                        e.batch_id,
                        e.worker,
                        time.time() - e.beat,
                        "requeued" if lost.requeued else "its pool had requeued it",
                    )
                self._requeue_stranded()
            except redis.RedisError as exc:
                log.warning("lease and lost-worker sweep: broker unreachable (%s); retrying", exc)
            except Exception:  # noqa: BLE001 - the sweep must not stop the lease's heartbeat
                log.exception("lost-worker sweep failed; retrying")

    def _requeue_stranded(self) -> None:
        """Batches in flight that no message carries any more (Redis shut down between a
        worker's pop of a message and its record of it, ``Ledger.stranded``) are queued again
        from the copies that `submit` kept, once they stay so for STRANDED_S with nothing stored
        meanwhile: the run would otherwise never end. A batch analysed twice is stored once."""
        from headatlas.workers.app import ANALYSIS_QUEUE, make_app, send_batch

        now = time.monotonic()
        for run_key in self.ledger.active_runs():
            lost = self.ledger.stranded(run_key, ANALYSIS_QUEUE)
            done = len(self.ledger.done(run_key)) if lost else 0
            seen, now_due = stranded_long_enough(self._stranded.get(run_key), lost, done, now, STRANDED_S)
            if seen is None:
                self._stranded.pop(run_key, None)
            else:
                self._stranded[run_key] = seen
            if not now_due:
                continue
            copies = self.ledger.copies(run_key, lost)
            app = make_app(self.settings)
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
        if other is None and self.lease.reclaim():
            log.warning(
                "the ingest queue's lease had vanished (Redis was away over %.0f s, or restarted without its data); "
                "holding it again",
                SILENT_S,
            )
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
        from headatlas.service.storage import queue_store

        log.warning("Redis lost its data (restarted without persistence?): queues and live run state are gone")
        declare_queues(self.settings)
        try:
            with self.store.read() as conn:
                rows = conn.execute(
                    text(
                        "SELECT run_id, run_key, name FROM runs WHERE engine = 'queue' "
                        "AND status NOT IN ('done', 'failed') ORDER BY run_id"
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
                time.sleep(1.0)
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
                time.sleep(0.05)
            except StoreBusy as exc:
                log.warning("%s; retrying", exc)
                recovered = False
                time.sleep(1.0)
            if self._away is not None and recovered:
                log.warning("database %s is back; storing again", self.db_label)
                self._away = None

    # --- a lake unavailable: its catalogue connection lost, its data path full or read-only ------
    def _unavailable(self, exc: StoreUnavailable) -> None:
        """Pause: say so (once per cause) in the log and to `status`, wait, double the wait."""
        pause = self._pause
        if pause is None or (pause.waits_for, pause.cause) != (exc.waits_for, exc.cause):
            if pause is None:
                pause = self._pause = Pause(exc.waits_for, exc.cause, time.monotonic(), time.time())
                ended, delay, cause = self._resumed_at
                again = time.monotonic() - ended < FLAP_S  # the probe passed, the work did not (a data
                if again:  # path with little room): go on backing off, and say it once
                    pause.delay = delay
                verb = "" if again and cause == (exc.waits_for, exc.cause) else "paused"
            else:
                pause.waits_for, pause.cause = exc.waits_for, exc.cause
                verb = f"still paused ({time.monotonic() - pause.since:.1f} s)"
            log.log(
                logging.ERROR if verb else logging.DEBUG,
                "%s: %s; %s message(s) wait in Redis (none is lost); waiting for %s, trying again every %.1f s "
                "doubling to %.0f s",
                verb or "paused again",
                exc,
                self._backlog(),
                exc.waits_for,
                PAUSE_FIRST_S,
                PAUSE_MAX_S,
            )
        from headatlas.service.storage.backends.lake import DATA_PATH

        pause.data_path = pause.data_path or exc.waits_for == DATA_PATH
        pause.tries += 1
        try:
            self.lease.say_paused(pause.waits_for, pause.cause, pause.wall, pause.delay, pause.tries)
        except redis.RedisError:
            pass  # the broker is away too: the loop finds out
        time.sleep(pause.delay)
        pause.delay = min(2 * pause.delay, PAUSE_MAX_S)

    def _probe(self) -> None:
        """Raise StoreUnavailable while what the writer waits for (its lake's catalogue, when it
        is not paused) is still unavailable."""
        from headatlas.service.storage.backends.lake import CATALOGUE, LakeBackend

        if isinstance(self.backend, LakeBackend):
            self.backend.probe(self._pause.waits_for if self._pause is not None else CATALOGUE)

    def _resumed(self) -> None:
        """The fault cleared (the probe passed): say after how long, and the data files the failed
        writes left; the messages go back on the queue and are stored now."""
        pause, self._pause = self._pause, None
        assert pause is not None
        self._resumed_at = (time.monotonic(), pause.delay, (pause.waits_for, pause.cause))
        took = time.monotonic() - pause.since
        orphans = ""
        if pause.data_path:
            orphans = self._count_orphans()
        log.warning(
            "%s is back after %.1f s (%d failed attempt(s)); storing again%s",
            pause.waits_for,
            took,
            pause.tries,
            orphans,
        )
        try:
            self.lease.clear_paused()
        except redis.RedisError:
            pass

    def _count_orphans(self) -> str:
        """The lake's uncatalogued data files (writes that failed after creating their file), for
        the log and `status`; `db compact` removes them once they are an hour old (a younger one
        may still be committed by a transaction in flight elsewhere)."""
        from headatlas.service.storage.backends.lake import ORPHAN_AGE_S, LakeBackend

        if not isinstance(self.backend, LakeBackend):
            return ""
        try:
            found = len(self.backend.orphan_files())
        except HeadatlasError as exc:
            return f"; could not count the uncatalogued data files ({exc})"
        try:
            ledger = getattr(self, "ledger", None) or Ledger(self.lease.r, self.database_id)
            ledger.r.hset(ledger.key(ORPHANS, "lake"), mapping={"files": found, "at": f"{time.time():.3f}"})
        except redis.RedisError:
            pass
        if not found:
            return "; the failed writes left no data file"
        return (
            f"; {found} uncatalogued data file(s) in the data path, left by the writes that failed: "
            f"`headatlas db compact` removes them once {ORPHAN_AGE_S / 3600:.0f} h old"
        )

    def _backlog(self) -> int | str:
        try:
            r = self.lease.r
            return int(r.llen(INGEST)) + sum(int(r.llen(name)) for name in processing_lists(r))
        except redis.RedisError:
            return "?"

    def _database_away(self, why: str) -> None:
        if why != self._away:
            try:
                waiting = self.ledger.backlog()
            except redis.RedisError:
                waiting = -1
            log.error(
                "%s (%s message(s) waiting); the writer pauses and looks again every %.0f s",
                why,
                "?" if waiting < 0 else waiting,
                AWAY_POLL_S,
            )
            self._away = why

    def step(self, timeout_s: float = 1.0) -> int:
        """Take up to GROUP messages, store them, commit, remove them. Returns how many."""
        if isinstance(self.store, OwnStore):
            self.store.check()  # a database away: take nothing
        raw = self._take(timeout_s)
        if not raw:
            return 0
        started = time.monotonic()
        self.handle([json.loads(m) for m in raw])
        self.ledger.r.delete(self.processing)
        # With a backlog the writer would reopen the file at once, and readers (status, query,
        # sql), which retry on its lock with backoff, would seldom find it free: it stays
        # closed as long as it was held, so a reader's try succeeds at least every other time.
        time.sleep(max(READER_GAP_S, time.monotonic() - started))
        return len(raw)

    def _stop(self, _signum, _frame) -> None:
        self.stopping = True

    def _recover(self) -> None:
        """Messages a previous writer took but did not finish go back to the head, in order."""
        while self.ledger.r.lmove(self.processing, INGEST, "RIGHT", "LEFT"):
            pass

    def _take(self, timeout_s: float) -> list[bytes]:
        # BLMOVE takes a double timeout (seconds, fractions allowed); redis-py annotates it as int
        first = self.ledger.r.blmove(INGEST, self.processing, timeout_s, "LEFT", "RIGHT")  # type: ignore[arg-type]
        if first is None:
            return []
        pipe = self.ledger.r.pipeline()
        for _ in range(GROUP - 1):
            pipe.lmove(INGEST, self.processing, "LEFT", "RIGHT")
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
                if run_is_there(conn, run_id, run_key):  # not a run deleted meanwhile
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
            self.db_label,
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
                    f"the writer on {self.settings.broker_url} now stores into {self.db_label} (database "
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
        except StoreBusy:
            raise  # busy or away: the message stays, and is handled when the file is back
        except HeadatlasError as exc:
            self.ledger.set_run_error(run_key, str(exc))  # the submitter is waiting for it
        finally:
            self.ledger.writer_state("idle")

    def _run_id(self, run_key: str, *, refresh: bool = False) -> int | None:
        """The database id of a run, created from the submitter's description on first sight;
        ``refresh`` re-reads the description (the submitter has finished cutting the corpus).
        None for a run deleted (`runs delete`) since a writer opened it: never created again,
        until the corpus is submitted again."""
        if run_key not in self.run_ids or refresh:
            if self.ledger.deleted(run_key):
                return None
            meta = self.ledger.run_meta(run_key)
            if meta is None:
                log.warning("run %s: no description in Redis (lost?); submit the corpus again", run_key)
                return None
            opened, _error = self.ledger.run_id(run_key)
            if opened is not None and not refresh:  # a writer opened it: it is in the database, or was deleted
                with self.store.read() as conn:
                    there = queue_store.find_run_by_key(conn, run_key) is not None
                if not there:
                    self._run_gone(run_key, opened)
                    return None
            run, _plan = queue_store.open_run(self.store, meta)
            self.ledger.set_run_id(run_key, run.run_id)
            self.run_ids[run_key] = run.run_id
        return self.run_ids[run_key]

    def _store_group(self, group: list[dict]) -> None:
        if not group:
            return
        known = self._known(group)
        self.ledger.writer_state("ingesting", batches=len(known))
        summaries: dict[str, queue_store.Summary] = {}
        lake = not self.store.backend.keys
        if lake:
            known = self._without(known, self._reserve(known))
        if not known:
            self.ledger.writer_state("idle")
            return
        try:
            try:
                with self.store.write() as conn:
                    known = self._without(known, self._gone(conn, known))
                    outcomes = self._apply_group(conn, known)
                    for run_id in {r for _m, r in known}:
                        queue_store.finish_if_complete(conn, run_id)
                    summaries = {m["run_key"]: queue_store.summary(conn, r) for m, r in known}
                if lake:  # a run's end, seen after this commit: with every writer's batches
                    summaries = self.store.atomically(lambda conn: self._finish(conn, known))
            except StoreBusy:
                raise  # a reader held the file for long: the messages stay in processing
            except StoreError:
                outcomes = self._one_by_one(known)
            except Exception:  # noqa: BLE001 - a message the database refuses must not stop the writer
                log.exception("a group of %d message(s) failed; storing them one by one", len(known))
                outcomes = self._one_by_one(known)
            if not summaries:
                summaries = self.store.atomically(lambda conn: self._finish(conn, known, finish=False))
        finally:
            self.ledger.writer_state("idle")
        pipe = self.ledger.r.pipeline()
        for (msg, _run_id), (failed, windows) in zip(known, outcomes):
            if failed is not None:
                self.ledger.finished(msg["run_key"], msg["batch_id"], failed=failed, windows=windows, pipe=pipe)
        pipe.execute()
        for run_key, summary in summaries.items():
            self._announce(run_key, summary)

    def _known(self, group: list[dict]) -> list[tuple[dict, int]]:
        """The group's messages with their run's id; a deleted run's are dropped."""
        known: list[tuple[dict, int]] = []
        dropped: list[dict] = []
        for msg in group:
            run_id = self._run_id(msg["run_key"])
            if run_id is None:
                dropped.append(msg)
            else:
                known.append((msg, run_id))
        for msg in dropped:
            if self.ledger.deleted(msg["run_key"]):
                self.ledger.forget(msg["run_key"], msg["batch_id"])
        return known

    def _reserve(self, known) -> set[int]:
        """A lake: the group's batches get a ledger row each before they are stored, in a
        transaction of their own (``store.reserve_batches``: what makes two stores of one batch
        conflict), which holds each run's row (``run_is_there``: what makes a store and a delete
        of the run conflict). Returns the runs deleted meanwhile."""
        by_run: dict[int, list[int]] = {}
        runs = {run_id: msg["run_key"] for msg, run_id in known}
        for msg, run_id in known:
            if msg["kind"] == "ingest":
                by_run.setdefault(run_id, []).append(int(msg["batch_id"]))

        def work(conn: Connection) -> set[int]:
            gone = {r for r, k in runs.items() if not run_is_there(conn, r, k, hold=True)}
            for r, ids in by_run.items():
                if r not in gone:
                    reserve_batches(conn, r, ids)
            return gone

        return self.store.atomically(work) if runs else set()

    def _gone(self, conn: Connection, known) -> set[int]:
        """The runs of ``known`` deleted from the database (`runs delete`)."""
        runs = {run_id: msg["run_key"] for msg, run_id in known}
        return {r for r, k in runs.items() if not run_is_there(conn, r, k)}

    def _without(self, known, gone: set[int]) -> list[tuple[dict, int]]:
        """``known`` without the messages of the runs ``gone``, which are dropped."""
        if not gone:
            return known
        for run_id in gone:
            run_key = next(m["run_key"] for m, r in known if r == run_id)
            self._run_gone(run_key, run_id)
        for msg, run_id in known:
            if run_id in gone:
                self.ledger.forget(msg["run_key"], msg["batch_id"])
        return [(m, r) for m, r in known if r not in gone]

    def _run_gone(self, run_key: str, run_id: int) -> None:
        """Run ``run_id`` was deleted from the database while in flight: its messages are dropped,
        it is never created again (until submitted again), and a waiting `submit --wait` ends."""
        self.run_ids.pop(run_key, None)
        if self.ledger.deleted(run_key):
            return
        log.warning("run %s was deleted from the database while in flight: its batches are dropped", run_id)
        self.ledger.mark_deleted(run_key, deleted_message(run_id))

    def _finish(self, conn: Connection, known, *, finish: bool = True) -> dict[str, queue_store.Summary]:
        """Each run's end (``finish``) and summary; a run deleted since the group was stored has none."""
        gone = self._gone(conn, known)
        for run_id in gone:
            self._run_gone(next(m["run_key"] for m, r in known if r == run_id), run_id)
        for run_id in {r for _m, r in known} - gone:
            if finish:
                queue_store.finish_if_complete(conn, run_id)
        return {m["run_key"]: queue_store.summary(conn, r) for m, r in known if r not in gone}

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
        outcomes: list[tuple[bool | None, int]] = []
        for msg, run_id in known:
            try:
                with self.store.write() as conn:
                    if not run_is_there(conn, run_id, msg["run_key"]):
                        outcomes.append((None, 0))  # deleted meanwhile: dropped after the group
                        continue
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

    def _apply_group(self, conn: Connection, known) -> list[tuple[bool | None, int]]:
        """The group's outcomes, as ``_apply`` message by message would give them, with each
        run's batches stored by one insert per table (a lake writes a Parquet file per insert
        and table). A batch any database would refuse raises: the group is then stored one by
        one. Failures are recorded after the stores (never over a stored batch either way)."""
        outcomes: list[tuple[bool | None, int]] = [(None, 0)] * len(known)
        by_run: dict[int, list[tuple[int, dict]]] = {}
        for i, (msg, run_id) in enumerate(known):
            if msg["kind"] == "ingest":
                by_run.setdefault(run_id, []).append((i, msg))
        for run_id, entries in by_run.items():
            results = {}
            for _i, msg in entries:
                if msg["batch_id"] not in results:
                    results[msg["batch_id"]] = BatchResult.from_bytes(base64.b64decode(msg["payload"]))
            stored = set(ingest_batch_ids(conn, run_id, list(results.items())))
            for i, msg in entries:
                batch_id = msg["batch_id"]
                counted = batch_id in stored
                stored.discard(batch_id)  # a second delivery in the group counts nothing
                outcomes[i] = (False, len(results[batch_id].window_ids) if counted else 0)
        for i, (msg, run_id) in enumerate(known):
            if msg["kind"] == "failed":
                outcomes[i] = self._apply(conn, msg, run_id)
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
        except StoreBusy:
            raise  # a lake: not reserved, or a conflict; the group is stored again
        except StoreError as exc:
            # refused before anything was written (windows counted by another batch): the
            # transaction goes on; retrying cannot help
            changed = queue_store.mark_failed(conn, run_id, msg["batch_id"], attempts=1, error=str(exc))
            return (True if changed else None), 0
        return False, len(result.window_ids) if stored else 0


def _messages_for(client: redis.Redis, database_id: str) -> int:
    """Messages on the ingest queue (waiting or taken) for the database ``database_id``."""
    count = 0
    for raw in [
        *client.lrange(INGEST, 0, -1),
        *(m for name in processing_lists(client) for m in client.lrange(name, 0, -1)),
    ]:
        try:
            count += json.loads(raw).get("database_id") == database_id
        except ValueError:
            continue
    return count


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
