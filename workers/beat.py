"""The beat: fires due schedules by submitting their runs through the ordinary submit path.

A loop that reads the schedules from the database every tick (so an edit, a pause or a new
schedule takes effect at the next tick, without a restart) and, for each schedule whose next
fire has come, claims the fire in the database and submits the run. The claim — inserting the
(schedule, fire time) row — is what makes a fire create at most one run: two beat processes, or
one handling a tick twice, race for the same key and one insert wins.

A beat that dies between a claim and the end of its submission leaves the fire ``claimed``: the
claim carries a lease (holder, until when) that the beat renews while it submits, and once it has
run out the next beat to find the schedule due takes that fire over and submits it again, with
the documents it held (submission is idempotent: a run half queued is completed). An
``only_new`` fire's documents count as sent only once its run is submitted.

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
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from headatlas.service.config import Settings
from headatlas.service.errors import BrokerError, HeadatlasError, StoreBusy, StoreError
from headatlas.service.schedules import due_fire
from headatlas.service.storage import schedule_store
from headatlas.service.storage.schedule_store import Schedule
from headatlas.service.storage.store import Store, now

log = logging.getLogger("headatlas.beat")

TICK_LOCK_WAIT_S = 0.3  # a tick waits this long at most for the database file, then uses its last read
REREAD_S = 10.0  # schedules are read again at least this often, changed or not


def _file_stamp(db: str) -> tuple:
    """Changes whenever the database is written (its file or its write-ahead log). A lake has no
    file to watch, and its readers never hold up a writer: it is read every tick."""
    from headatlas.service.storage.backends import open_backend

    if open_backend(db).kind != "file":
        return (time.monotonic(),)
    out: list[tuple[int, int] | None] = []
    for path in (Path(db), Path(f"{db}.wal")):
        try:
            st = path.stat()
            out.append((st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            out.append(None)
    return tuple(out)


@dataclass
class Fired:
    claimed: bool
    status: str = ""
    run_name: str | None = None
    documents: int | None = None
    error: str | None = None
    resumed: bool = False  # the fire submitted was one another process had left


def spool_folder(settings: Settings, schedule: str) -> Path:
    from headatlas.service.storage.backends import open_backend

    base = (
        Path(settings.spool_dir) if settings.spool_dir else open_backend(settings.db).local_folder() / "headatlas-spool"
    )
    return base / "schedules" / schedule


LEASE_S = 60.0  # a fire's holder renews its hold every third of this; a beat dead this long is taken over


def holder_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def fire(
    settings: Settings,
    sched: Schedule,
    fire_time: datetime,
    *,
    kind: str = "scheduled",
    at: datetime | None = None,
    holder: str | None = None,
    lease_s: float = LEASE_S,
    clock: Callable[[], datetime] = now,
) -> Fired:
    """Claim (schedule, fire_time) and, when this caller won the claim, submit its run. A fire of
    the schedule that another process claimed and left unsubmitted (its lease ran out) is
    submitted first, in its place (``Fired.resumed``; the fire asked for stays due). ``at``: the
    time of the claim (default now); ``clock``: the time the lease is renewed against."""
    from headatlas.service.engine.corpus import iter_documents

    holder = holder or holder_name()
    at = at or clock()
    with Store(settings.db).checked_read() as conn:
        if schedule_store.held_elsewhere(schedule_store.in_hand(conn, sched.schedule_id), holder, at):
            return Fired(False, "in_hand")  # another live process is submitting one: this fire stays due
        seen = schedule_store.seen_documents(conn, sched.schedule_id) if sched.only_new else set()
    new: dict[str, str] | None = None
    if sched.only_new:
        new = {}
        for doc in iter_documents(sched.corpus):
            if doc.doc_id not in seen:
                new.setdefault(doc.doc_id, doc.text)
    got = schedule_store.claim(
        settings.db,
        sched.schedule_id,
        fire_time,
        kind=kind,
        holder=holder,
        lease_s=lease_s,
        doc_ids=list(new) if new is not None else None,
        at=at,
    )
    if got is None:
        return Fired(False)
    if new is not None and got.doc_ids is not None:
        wanted = set(got.doc_ids)
        new = {d: t for d, t in new.items() if d in wanted}  # a fire taken over sends what it had
    with _lease(settings, sched.schedule_id, got.fire_time, holder, lease_s, clock):
        result = _submit(settings, sched, got.fire_time, new)
    result.resumed = got.resumed
    return result


def _submit(settings: Settings, sched: Schedule, fire_time: datetime, new: dict[str, str] | None) -> Fired:
    from headatlas.service.params import AnalysisParams
    from headatlas.workers.submit import submit

    spec = sched.corpus
    run_name = f"{sched.name}-{fire_time:%Y%m%d-%H%M%S}"
    if new is not None:
        if not new:
            schedule_store.finish_fire(
                settings.db, sched.schedule_id, fire_time, status="no_new_documents", documents=0
            )
            return Fired(True, "no_new_documents", documents=0)
        spec = str(_spool(spool_folder(settings, sched.name) / f"{fire_time:%Y%m%d-%H%M%S}.jsonl", new.values()))
    try:
        params = AnalysisParams.from_dict(sched.params)
        sub = submit(
            spec,
            settings=settings,
            model=sched.model,
            dtype=sched.dtype,
            params=params,
            batch_size=sched.batch_size,
            name=run_name,
            writer_wait_s=0.0,
        )
    except HeadatlasError as exc:
        schedule_store.finish_fire(settings.db, sched.schedule_id, fire_time, status="error", error=str(exc))
        return Fired(True, "error", error=str(exc))
    documents = len(new) if new is not None else None
    schedule_store.finish_fire(
        settings.db,
        sched.schedule_id,
        fire_time,
        status="submitted",
        run_key=sub.run_key,
        run_name=sub.name,
        documents=documents,
    )
    return Fired(True, "submitted", sub.name, documents)


@contextmanager
def _lease(settings: Settings, schedule_id: int, fire_time: datetime, holder: str, lease_s: float, clock):
    """Renew the hold on a fire every third of its lease while its run is submitted."""
    done = threading.Event()

    def renew() -> None:
        while not done.wait(lease_s / 3):
            try:
                schedule_store.renew(
                    settings.db, schedule_id, fire_time, holder=holder, until=clock() + timedelta(seconds=lease_s)
                )
            except HeadatlasError as exc:  # the next renewal may get through; a lapse means a resubmission
                log.warning("fire %s: lease not renewed: %s", fire_time, exc)

    thread = threading.Thread(target=renew, name=f"lease-{schedule_id}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _spool(path: Path, texts) -> Path:
    """The new documents as a JSONL corpus (written once, renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as out:
        for text in texts:
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def _warm_up() -> None:
    """Import what a fire needs now: a first fire paid the imports (tens of seconds on a
    loaded machine) and came that late."""
    import transformers  # noqa: F401

    import headatlas.workers.app  # noqa: F401
    import headatlas.workers.submit  # noqa: F401
    from headatlas.service.engine.model import load_model_info  # noqa: F401
    from headatlas.service.engine.run_plan import run_key  # noqa: F401


class Beat:
    """``clock``: what "now" is (UTC, naive), read once a tick and for each claim; tests pass a
    clock of their own, so that when fires come is checked without waiting for them."""

    def __init__(
        self, settings: Settings, *, tick_s: float = 1.0, clock: Callable[[], datetime] = now, lease_s: float = LEASE_S
    ):
        self.settings, self.tick_s, self.stopping, self.clock = settings, tick_s, False, clock
        self.holder, self.lease_s = holder_name(), lease_s  # this beat's name on the fires it holds
        self.in_hand: dict[int, threading.Thread] = {}  # schedule id -> its fire being submitted
        self.started: dict[int, datetime] = {}  # schedule id -> the latest fire time started here
        self.schedules: list[Schedule] = []  # as last read
        self.read_stamp: tuple | None = None  # the database file as it was when last read
        self.read_at = 0.0

    def run(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)  # finish the fire in hand, then leave
        from headatlas.service.storage.backends import label

        log.info("beat: reading schedules from %s every %.1f s", label(self.settings.db), self.tick_s)
        _warm_up()
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
        from headatlas.service.storage.backends import open_backend
        from headatlas.workers.ledger import connect

        if not open_backend(self.settings.db).exists():
            return 0
        # Reading only when the file changed: beats reading every tick kept it held read-only
        # so often that claims (which write) waited seconds for it.
        stamp = _file_stamp(self.settings.db)
        if stamp != self.read_stamp or time.monotonic() - self.read_at >= REREAD_S:
            try:
                with schedule_store.read(self.settings.db, lock_wait_s=TICK_LOCK_WAIT_S) as conn:
                    self.schedules = schedule_store.all_schedules(conn)
                self.read_stamp, self.read_at = stamp, time.monotonic()
            except StoreBusy:
                pass  # another process holds the file: fire from the last read; the claim checks it
        at = self.clock()
        due = [
            (s, t)
            for s in self.schedules
            if s.enabled
            and (t := due_fire(s.cadence, s.next_fire, at)) is not None
            and t > self.started.get(s.schedule_id, datetime.min)
        ]
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
            self.started[sched.schedule_id] = fire_time
            thread.start()
            started += 1
        return started

    def _fire(self, sched: Schedule, fire_time: datetime) -> None:
        try:
            result = fire(
                self.settings,
                sched,
                fire_time,
                at=self.clock(),
                holder=self.holder,
                lease_s=self.lease_s,
                clock=self.clock,
            )
        except HeadatlasError as exc:  # the database or Redis away: the fire stays due, or claimed
            log.warning("schedule %s, fire %s: %s", sched.name, fire_time, exc)
            return
        except Exception:  # noqa: BLE001 - one schedule's failure must not stop the others
            log.exception("schedule %s, fire %s failed", sched.name, fire_time)
            return
        if result.resumed or result.status == "in_hand":
            # the fire asked for was not claimed (another fire of the schedule came first): still due
            self.started.pop(sched.schedule_id, None)
        if result.claimed:
            log.info(
                "schedule %s fired%s: %s %s",
                sched.name,
                " (a fire left by a beat that stopped, taken over)" if result.resumed else f" for {fire_time}",
                result.status,
                result.run_name or result.error or "",
            )

    def _stop(self, _signum, _frame) -> None:
        self.stopping = True
