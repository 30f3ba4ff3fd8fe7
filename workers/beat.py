"""The beat: fires due schedules by submitting their runs through the ordinary submit path.

A loop that reads the schedules from the database every tick (so an edit, a pause or a new
schedule takes effect at the next tick, without a restart) and, for each schedule whose next
fire has come, claims the fire in the database and submits the run. The claim — inserting the
(schedule, fire time) row — is what makes a fire create at most one run: two beat processes, or
one handling a tick twice, race for the same key and one insert wins.

Missed fires (beat was down): only the latest scheduled time that has passed fires, once; the
next fire is the first scheduled time after now.

A fire (reading the corpus, tokenising it, queueing its batches) can take longer than a short
schedule's period on a busy machine; it runs in a thread of its own, so the tick loop keeps
reading the schedules every tick and other schedules fire on time. One fire per schedule is in
hand at a time in a process.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from service.config import Settings
from service.errors import BrokerError, HeadatlasError, StoreError
from service.schedules import due_fire
from service.storage import schedule_store
from service.storage.schedule_store import Schedule
from service.storage.store import Store, now

log = logging.getLogger("headatlas.beat")


@dataclass
class Fired:
    claimed: bool
    status: str = ""
    run_name: str | None = None
    documents: int | None = None
    error: str | None = None


def spool_folder(settings: Settings, schedule: str) -> Path:
    base = Path(settings.spool_dir) if settings.spool_dir else Path(settings.db).resolve().parent / "headatlas-spool"
    return base / "schedules" / schedule


def fire(settings: Settings, sched: Schedule, fire_time: datetime, *, kind: str = "scheduled") -> Fired:
    """Claim (schedule, fire_time) and, when this caller won the claim, submit its run."""
    from service.corpus import iter_documents
    from service.params import AnalysisParams
    from workers.submit import submit

    spec, new = sched.corpus, None
    if sched.only_new:
        with Store(settings.db).checked_read() as conn:
            seen = schedule_store.seen_documents(conn, sched.schedule_id)
        new = {}
        for doc in iter_documents(sched.corpus):
            if doc.doc_id not in seen:
                new.setdefault(doc.doc_id, doc.text)
    if not schedule_store.claim(settings.db, sched.schedule_id, fire_time, kind=kind,
                                doc_ids=list(new) if new is not None else None):
        return Fired(False)
    run_name = f"{sched.name}-{fire_time:%Y%m%d-%H%M%S}"
    if new is not None:
        if not new:
            schedule_store.finish_fire(settings.db, sched.schedule_id, fire_time, status="no_new_documents", documents=0)
            return Fired(True, "no_new_documents", documents=0)
        spec = str(_spool(spool_folder(settings, sched.name) / f"{fire_time:%Y%m%d-%H%M%S}.jsonl", new.values()))
    try:
        params = AnalysisParams.from_dict(sched.params)
        sub = submit(spec, settings=settings, model=sched.model, dtype=sched.dtype, params=params,
                     batch_size=sched.batch_size, name=run_name, writer_wait_s=0.0)
    except HeadatlasError as exc:
        schedule_store.finish_fire(settings.db, sched.schedule_id, fire_time, status="error", error=str(exc))
        return Fired(True, "error", error=str(exc))
    documents = len(new) if new is not None else None
    schedule_store.finish_fire(settings.db, sched.schedule_id, fire_time, status="submitted", run_key=sub.run_key,
                               run_name=sub.name, documents=documents)
    return Fired(True, "submitted", sub.name, documents)


def _spool(path: Path, texts) -> Path:
    """The new documents as a JSONL corpus (written once, renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


class Beat:
    def __init__(self, settings: Settings, *, tick_s: float = 1.0):
        self.settings, self.tick_s, self.stopping = settings, tick_s, False
        self.in_hand: dict[int, threading.Thread] = {}  # schedule id -> its fire being submitted

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)  # finish the fire in hand, then leave
        log.info("beat: reading schedules from %s every %.1f s", self.settings.db, self.tick_s)
        while not self.stopping:
            try:
                self.tick()
            except StoreError as exc:
                log.warning("%s; retrying", exc)
            except BrokerError as exc:
                log.warning("%s; due schedules fire when it answers", exc)
            time.sleep(self.tick_s)
        for thread in list(self.in_hand.values()):
            thread.join()  # the fires in hand end as claimed and submitted, or as errors

    def tick(self) -> int:
        """Start a fire of every due schedule that has none in hand here. Returns how many."""
        from workers.ledger import connect

        if not Path(self.settings.db).exists():
            return 0
        with Store(self.settings.db).checked_read() as conn:
            schedules = schedule_store.all_schedules(conn)
        due = [(s, t) for s in schedules if s.enabled and (t := due_fire(s.cadence, s.next_fire, now())) is not None]
        if not due:
            return 0
        connect(self.settings.broker_url)  # Redis away: leave the fires due rather than claim and fail them
        started = 0
        for sched, fire_time in due:
            previous = self.in_hand.get(sched.schedule_id)
            if previous is not None and previous.is_alive():
                continue  # still submitting its previous fire: this one stays due
            thread = threading.Thread(target=self._fire, args=(sched, fire_time), name=f"fire-{sched.name}")
            self.in_hand[sched.schedule_id] = thread
            thread.start()
            started += 1
        return started

    def _fire(self, sched: Schedule, fire_time: datetime) -> None:
        try:
            result = fire(self.settings, sched, fire_time)
        except HeadatlasError as exc:  # the database or Redis away: the fire stays due, or claimed
            log.warning("schedule %s, fire %s: %s", sched.name, fire_time, exc)
            return
        except Exception:  # noqa: BLE001 - one schedule's failure must not stop the others
            log.exception("schedule %s, fire %s failed", sched.name, fire_time)
            return
        if result.claimed:
            log.info("schedule %s fired for %s: %s %s", sched.name, fire_time, result.status,
                     result.run_name or result.error or "")

    def _stop(self, _signum, _frame) -> None:
        self.stopping = True
