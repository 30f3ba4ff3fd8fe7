"""How the writer stores batch messages: consecutive results and failures of batches, in one
transaction per group (opening and closing a DuckDB file costs more than storing a small batch),
each run's batches by one insert per table; a group the database refuses is stored message by
message, a bad one marked failed. On a lake, batches are reserved first, and a run's end is asked
after the commit (docs/architecture.md, "Exactly once on a lake"). A run deleted meanwhile
(`runs delete`) has its messages dropped and is never created again.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from headatlas.service.engine.results import (
    BatchResult,
)  # numpy only: importing torch here cost seconds inside the first transaction
from headatlas.service.errors import HeadatlasError, RunDeleted, StoreBusy, StoreError
from headatlas.service.statuses import ENDED, RunStatus
from headatlas.service.storage import queue_store
from headatlas.service.storage.ingest import ingest_batch_ids, ingest_batches, reserve_batches
from headatlas.service.storage.runs import run_is_there
from headatlas.service.storage.store import Store
from headatlas.workers.ledger import Ledger, deleted_message
from headatlas.workers.messages import BatchAnalysed, BatchFailed, BatchMessage

log = logging.getLogger("headatlas.writer")

Known = list[tuple[BatchMessage, int]]  # a group's messages with their run's id
Outcome = tuple[bool | None, int]  # (failed?, windows newly counted); failed is None when nothing changed


@dataclass(frozen=True)
class AddedEffects:
    """A queued measurement of effects added to a finished run (``effects RUN --queue``,
    workers/submit_effects.py): its messages name it by a key of its own; its batches are stored
    into run ``run_id`` (stored under ``run_key``), which is to hold every batch of ``batches``.
    A batch of it that fails is not written into the run (whose own batches it is not): Redis
    keeps the failure, and submitting again queues the window anew."""

    run_id: int
    run_key: str
    batches: frozenset[int]


class GroupIngest:
    """The writer's storing of batch messages (a part of ``Writer``)."""

    ledger: Ledger
    store: Store
    run_ids: dict[str, int]
    added_effects: dict[str, AddedEffects]  # by the measurement's key
    refused: set[str]  # measurements the database refused (the run changed): their messages are dropped
    results_due: set[int]  # runs ended whose results are derived when the writer is idle
    outside_s: float = 0.0  # seconds of this step's work done with the file closed (decoding)

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
            # a writer opened it before: it is in the database, or was deleted (then not created again)
            opened, _error = self.ledger.run_id(run_key)
            try:
                if "effects_of" in meta:
                    run_id = self._open_added_effects(run_key, meta)
                else:
                    run_id = queue_store.open_run(self.store, meta, opened=opened)[0].run_id
            except RunDeleted as gone:
                self._run_gone(run_key, gone.run_id)
                return None
            except StoreBusy:
                raise
            except HeadatlasError as exc:
                if "effects_of" not in meta:
                    raise
                log.warning("effects for run %s refused: %s", meta.get("run_id"), exc)
                self.refused.add(run_key)
                self.ledger.set_run_error(run_key, str(exc))  # a waiting `effects RUN --queue --wait` says it
                return None
            self.ledger.set_run_id(run_key, run_id)
            self.run_ids[run_key] = run_id
        return self.run_ids[run_key]

    def _open_added_effects(self, run_key: str, meta: dict) -> int:
        """Open a measurement of added effects: its run (finished, still there) records the
        effects it is to hold, in one transaction (again at each opening: the same values).
        Refused (``StoreError``) where the run holds other effects by now."""
        from headatlas.service.storage.added_effect_rows import check_finished, record_added_effects

        run_id, stored_key = int(meta["run_id"]), str(meta["effects_of"])

        def work(conn: Connection) -> None:
            if not run_is_there(conn, run_id, stored_key, hold=True):
                raise RunDeleted(run_id)
            check_finished(conn, run_id, stored_key)
            record_added_effects(conn, run_id, meta["effect_fields"], int(meta["analysed"]))

        self.store.atomically(work)
        self.refused.discard(run_key)
        self.added_effects[run_key] = AddedEffects(run_id, stored_key, frozenset(int(b) for b in meta["batch_ids"]))
        return run_id

    def _stored_key(self, run_key: str) -> str:
        """The key the run of messages keyed ``run_key`` is stored under (a measurement of added
        effects: its run's)."""
        added = self.added_effects.get(run_key)
        return added.run_key if added is not None else run_key

    def _end(self, conn: Connection, run_key: str, run_id: int) -> None:
        """End the run once every batch is stored or failed; a measurement of added effects:
        compact its run once every window it is to hold is stored."""
        added = self.added_effects.get(run_key)
        if added is None:
            queue_store.finish_if_complete(conn, run_id)
            return
        from headatlas.service.storage.added_effect_rows import finish_queued

        finish_queued(conn, run_id, set(added.batches))

    def _summary(self, conn: Connection, run_key: str, run_id: int, known: Known | None = None) -> queue_store.Summary:
        """What the database holds of the run (a measurement of added effects: of its batches,
        with those failed as Redis has them and as ``known`` fails them now)."""
        added = self.added_effects.get(run_key)
        if added is None:
            return queue_store.summary(conn, run_id)
        from headatlas.service.storage.added_effect_rows import queued_summary

        failed = self.ledger.failed(run_key) | {
            m.batch_id for m, _r in known or [] if isinstance(m, BatchFailed) and m.run_key == run_key
        }
        return queued_summary(conn, run_id, set(added.batches), failed)

    def _store_group(self, group: list[BatchMessage]) -> None:
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
        decoded = self._decoded(known)
        try:
            try:
                with self.store.write() as conn:
                    known = self._without(known, self._gone(conn, known))
                    outcomes = self._apply_group(conn, known, decoded)
                    runs = list(dict.fromkeys((m.run_key, r) for m, r in known))  # each run once, in order
                    for run_key, run_id in runs:
                        self._end(conn, run_key, run_id)
                    # one summary per run, not per message (a group holds up to 512 messages, most of one run)
                    summaries = {run_key: self._summary(conn, run_key, run_id, known) for run_key, run_id in runs}
                if lake:  # a run's end, seen after this commit: with every writer's batches
                    summaries = self.store.atomically(lambda conn: self._finish(conn, known))
            except StoreBusy:
                raise  # a reader held the file for long: the messages stay in processing
            except StoreError:
                outcomes = self._one_by_one(known)
            except Exception:  # noqa: BLE001 - a message the database refuses must not stop the writer
                log.exception("a group of %d message(s) failed; storing them one by one", len(known))
                outcomes = self._one_by_one(known)
            if not summaries:  # stored one by one; a lake's end is asked after those commits too
                summaries = self.store.atomically(lambda conn: self._finish(conn, known, finish=lake))
        finally:
            self.ledger.writer_state("idle")
        pipe = self.ledger.r.pipeline()
        for (msg, _run_id), (failed, windows) in zip(known, outcomes):
            if failed is not None:
                self.ledger.finished(msg.run_key, msg.batch_id, failed=failed, windows=windows, pipe=pipe)
        pipe.execute()
        for run_key, summary in summaries.items():
            self._announce(run_key, summary)

    def _decoded(self, known: Known) -> dict[int, BatchResult]:
        """The payloads of the group's results, decoded before its transaction opens the file
        (about 0.2–0.5 ms of CPU a window: readers wait for none of it), keyed by ``id`` of
        their message; one that does not decode is left to the transaction, which fails it.
        Their seconds are added to ``outside_s`` (the reader gap counts only the file's)."""
        started = time.monotonic()
        out: dict[int, BatchResult] = {}
        for msg, _run_id in known:
            if isinstance(msg, BatchAnalysed) and id(msg) not in out:
                try:
                    out[id(msg)] = msg.result()
                except Exception:  # noqa: BLE001, S112 - decoded again inside, where it fails the batch
                    continue
        self.outside_s += time.monotonic() - started
        return out

    def _known(self, group: list[BatchMessage]) -> Known:
        """The group's messages with their run's id; a deleted run's are dropped."""
        known: Known = []
        dropped: list[BatchMessage] = []
        for msg in group:
            run_id = self._run_id(msg.run_key)
            if run_id is None:
                dropped.append(msg)
            else:
                known.append((msg, run_id))
        for msg in dropped:
            if self.ledger.deleted(msg.run_key) or msg.run_key in self.refused:
                self.ledger.forget(msg.run_key, msg.batch_id)
        return known

    def _reserve(self, known: Known) -> set[int]:
        """A lake: the group's batches get a ledger row each before they are stored, in a
        transaction of their own (``store.reserve_batches``: what makes two stores of one batch
        conflict), which holds each run's row (``run_is_there``: what makes a store and a delete
        of the run conflict). Returns the runs deleted meanwhile."""
        by_run: dict[int, list[int]] = {}
        runs = {run_id: self._stored_key(msg.run_key) for msg, run_id in known}
        for msg, run_id in known:
            if isinstance(msg, BatchAnalysed):
                by_run.setdefault(run_id, []).append(msg.batch_id)

        def work(conn: Connection) -> set[int]:
            gone = {r for r, k in runs.items() if not run_is_there(conn, r, k, hold=True)}
            for r, ids in by_run.items():
                if r not in gone:
                    reserve_batches(conn, r, ids)
            return gone

        return self.store.atomically(work) if runs else set()

    def _gone(self, conn: Connection, known: Known) -> set[int]:
        """The runs of ``known`` deleted from the database (`runs delete`)."""
        runs = {run_id: self._stored_key(msg.run_key) for msg, run_id in known}
        return {r for r, k in runs.items() if not run_is_there(conn, r, k)}

    def _without(self, known: Known, gone: set[int]) -> Known:
        """``known`` without the messages of the runs ``gone``, which are dropped."""
        if not gone:
            return known
        for run_id in gone:
            run_key = next(m.run_key for m, r in known if r == run_id)
            self._run_gone(run_key, run_id)
        for msg, run_id in known:
            if run_id in gone:
                self.ledger.forget(msg.run_key, msg.batch_id)
        return [(m, r) for m, r in known if r not in gone]

    def _run_gone(self, run_key: str, run_id: int) -> None:
        """Run ``run_id`` was deleted from the database while in flight: its messages are dropped,
        it is never created again (until submitted again), and a waiting `submit --wait` ends."""
        self.run_ids.pop(run_key, None)
        if self.ledger.deleted(run_key):
            return
        log.warning("run %s was deleted from the database while in flight: its batches are dropped", run_id)
        self.ledger.mark_deleted(run_key, deleted_message(run_id))

    def _finish(self, conn: Connection, known: Known, *, finish: bool = True) -> dict[str, queue_store.Summary]:
        """Each run's end (``finish``) and summary; a run deleted since the group was stored has none."""
        gone = self._gone(conn, known)
        for run_id in gone:
            self._run_gone(next(m.run_key for m, r in known if r == run_id), run_id)
        runs = list(dict.fromkeys((m.run_key, r) for m, r in known if r not in gone))
        for run_key, run_id in runs:
            if finish:
                self._end(conn, run_key, run_id)
        return {run_key: self._summary(conn, run_key, run_id, known) for run_key, run_id in runs}

    def _announce(self, run_key: str, summary: queue_store.Summary) -> None:
        """What the database now holds for the run, for `submit --wait` and the sweep."""
        self.ledger.set_run_status(
            run_key, summary.status, done=summary.done, failed=summary.failed, windows=summary.windows
        )
        if summary.status in ENDED and not self.ledger.in_flight(run_key):
            self.ledger.inactive(run_key)  # nothing of it runs any more: no need to sweep it
        if summary.status == RunStatus.DONE and run_key in self.run_ids:
            # its results are derived once (seconds of CPU for a run of 72 heads), but not here: this
            # runs inside the group's transaction, and batches of other runs wait behind it
            self.results_due.add(self.run_ids[run_key])

    def _store_results_due(self) -> None:
        """Derive and store one ended run's results (``reports.stored.refresh``: a no-op while they
        are current, never raises); called when no message waits, outside any transaction."""
        if not self.results_due:
            return
        from headatlas.service.reports.stored import refresh

        refresh(self.store, self.results_due.pop())

    def _one_by_one(self, known: Known) -> list[Outcome]:
        """After a group failed: each message in its own transaction, a bad one marked failed."""
        outcomes: list[Outcome] = []
        for msg, run_id in known:
            try:
                with self.store.write() as conn:
                    if not run_is_there(conn, run_id, self._stored_key(msg.run_key)):
                        outcomes.append((None, 0))  # deleted meanwhile: dropped after the group
                        continue
                    outcome = self._apply(conn, msg, run_id)
                    self._end(conn, msg.run_key, run_id)
            except StoreBusy:
                raise
            except Exception as exc:  # noqa: BLE001 - recorded on the batch, shown by `headatlas status`
                error = str(exc) if isinstance(exc, StoreError) else f"{type(exc).__name__}: {exc}"
                if msg.run_key in self.added_effects:  # not the run's own batch: Redis keeps the failure
                    self.ledger.errored(msg.run_key, msg.batch_id, error)
                    outcomes.append((True, 0))
                    continue
                with self.store.write() as conn:
                    changed = queue_store.mark_failed(conn, run_id, msg.batch_id, attempts=1, error=error)
                    queue_store.finish_if_complete(conn, run_id)
                outcome = (True if changed else None, 0)
            outcomes.append(outcome)
        return outcomes

    def _apply_group(
        self, conn: Connection, known: Known, decoded: dict[int, BatchResult] | None = None
    ) -> list[Outcome]:
        """The group's outcomes, as ``_apply`` message by message would give them, with each
        run's batches stored by one insert per table (a lake writes a Parquet file per insert
        and table). A batch any database would refuse raises: the group is then stored one by
        one. Failures are recorded after the stores (never over a stored batch either way)."""
        outcomes: list[Outcome] = [(None, 0)] * len(known)
        by_run: dict[int, list[tuple[int, BatchAnalysed]]] = {}
        for i, (msg, run_id) in enumerate(known):
            if isinstance(msg, BatchAnalysed):
                by_run.setdefault(run_id, []).append((i, msg))
        for run_id, entries in by_run.items():
            results: dict[int, BatchResult] = {}
            for _i, analysed in entries:
                if analysed.batch_id not in results:
                    ready = (decoded or {}).get(id(analysed))
                    results[analysed.batch_id] = ready if ready is not None else analysed.result()
            stored = set(ingest_batch_ids(conn, run_id, list(results.items())))
            for i, analysed in entries:
                batch_id = analysed.batch_id
                counted = batch_id in stored
                stored.discard(batch_id)  # a second delivery in the group counts nothing
                outcomes[i] = (False, len(results[batch_id].window_ids) if counted else 0)
        for i, (msg, run_id) in enumerate(known):
            if isinstance(msg, BatchFailed):
                outcomes[i] = self._apply(conn, msg, run_id)
        return outcomes

    def _apply(self, conn: Connection, msg: BatchMessage, run_id: int) -> Outcome:
        """(failed?, windows newly counted); failed is None when nothing changed."""
        if isinstance(msg, BatchFailed) and msg.run_key in self.added_effects:
            return True, 0  # not the run's own batch: Redis keeps the failure (AddedEffects)
        if isinstance(msg, BatchFailed):
            changed = queue_store.mark_failed(conn, run_id, msg.batch_id, attempts=msg.attempts, error=msg.error)
            return (True if changed else None), 0
        result = msg.result()
        try:
            stored = ingest_batches(conn, run_id, [(msg.batch_id, result)])
        except StoreBusy:
            raise  # a lake: not reserved, or a conflict; the group is stored again
        except StoreError as exc:
            # refused before anything was written (windows counted by another batch): the
            # transaction goes on; retrying cannot help
            changed = queue_store.mark_failed(conn, run_id, msg.batch_id, attempts=1, error=str(exc))
            return (True if changed else None), 0
        return False, len(result.window_ids) if stored else 0
