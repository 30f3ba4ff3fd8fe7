"""The writer: the one process that writes the database while runs go through the queue.

It consumes the ingest queue (a Redis list of messages from submitters and workers) as a
reliable queue: messages are moved atomically to a processing list, stored, committed, and only
then removed. A writer killed at any point leaves its messages in the processing list; the next
writer puts them back first, and ingest being idempotent (keyed by run and batch), a message
stored twice counts once. Consecutive batch results are stored in one transaction (group
commit): opening and closing the DuckDB file costs more than storing a small batch.
"""

from __future__ import annotations

import base64
import json
import logging
import signal
import time

import redis
from sqlalchemy.engine import Connection

from service.config import Settings
from service.errors import HeadatlasError, StoreBusy, StoreError
from service.storage import queue_store
from service.storage.store import Store, ingest_batches
from workers.ledger import INGEST, PROCESSING, Ledger, connect

log = logging.getLogger("headatlas.writer")

GROUP = 32  # messages per transaction at most (bounds how long a reader may wait)
READER_GAP_S = 0.025  # the file stays closed at least this long between transactions


class Writer:
    def __init__(self, settings: Settings):
        self.store = Store(settings.db)
        self.store.ensure_schema()  # a stale database fails now, not on the first batch
        self.ledger = Ledger(connect(settings.broker_url, check=False))
        self.run_ids: dict[str, int] = {}
        self.stopping = False

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)  # finish the group in hand, then leave
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
        first = self.ledger.r.blmove(INGEST, PROCESSING, timeout_s, "LEFT", "RIGHT")
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
        self._store_group(group)

    def _open_run(self, run_key: str) -> None:
        self.ledger.writer_state("opening", run=run_key)
        try:
            self._run_id(run_key, refresh=True)
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
        known = [(m, self._run_id(m["run_key"])) for m in group]
        known = [(m, r) for m, r in known if r is not None]
        self.ledger.writer_state("ingesting", batches=len(known))
        try:
            try:
                with self.store.write() as conn:
                    outcomes = [self._apply(conn, m, run_id) for m, run_id in known]
                    for run_id in {r for _m, r in known}:
                        queue_store.finish_if_complete(conn, run_id)
            except StoreBusy:
                raise  # a reader held the file for long: the messages stay in processing
            except StoreError:
                outcomes = self._one_by_one(known)
            except Exception:  # noqa: BLE001 - a message the database refuses must not stop the writer
                log.exception("a group of %d message(s) failed; storing them one by one", len(known))
                outcomes = self._one_by_one(known)
        finally:
            self.ledger.writer_state("idle")
        pipe = self.ledger.r.pipeline()
        for (msg, _run_id), (failed, windows) in zip(known, outcomes):
            if failed is not None:
                self.ledger.finished(msg["run_key"], msg["batch_id"], failed=failed, windows=windows, pipe=pipe)
        pipe.execute()

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
        from service.analysis import BatchResult

        if msg["kind"] == "failed":
            changed = queue_store.mark_failed(conn, run_id, msg["batch_id"], attempts=msg["attempts"], error=msg["error"])
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
