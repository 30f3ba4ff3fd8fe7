"""Where a distributed run stands: batches done / running / failed / pending, windows/s, ETA.

Done and failed come from the database (the record, read-only: it waits for the writer's short
transactions instead of failing on its lock); running, lost and waiting-for-the-writer come
from Redis (this database's keys), which alone knows them. Without Redis the database's counts
are shown. A running batch whose heartbeat stopped is shown as lost, not as running.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime

from headatlas.service.statuses import ENDED, RunStatus
from headatlas.service.storage.store import Store, now
from headatlas.workers.ledger import ORPHANS
from headatlas.workers.messages import PARKED


@dataclass
class RunReport:
    run_id: int
    name: str
    status: str
    batches: int | None
    done: int
    failed: int
    running: int | None
    ingesting: int | None
    pending: int | None
    windows_done: int
    windows: int | None
    windows_per_s: float | None
    eta_s: float | None
    error: str | None
    backlog: int | None = None  # messages waiting for the writer, all runs
    parked: int | None = None  # messages the writer could not read, parked (all runs)
    errors: list[tuple[int, int, str]] = field(default_factory=list)
    lost: list[LostInfo] = field(default_factory=list)
    writer: str | None = None  # who stores into this database, or why no one does (None: no broker)
    workers: int | None = None  # worker processes consuming the analysis queue (heartbeat)
    warnings: list[str] = field(default_factory=list)  # why the run may not move

    def record(self) -> dict:
        """The status as one record with named fields (--format json/csv); numbers stay numbers,
        unknown values are None, a failed batch is {batch, attempts, error}."""
        out = {k: v for k, v in asdict(self).items() if k != "errors"}
        out["errors"] = [{"batch": b, "attempts": a, "error": e} for b, a, e in self.errors]
        return out

    def rows(self) -> list[tuple[str, str]]:
        def show(value, unit=""):
            return "?" if value is None else f"{value:,}{unit}" if isinstance(value, int) else f"{value:,.1f}{unit}"

        out = [
            ("run", f"{self.run_id} ({self.name})"),
            ("status", self.status),
            ("batches", show(self.batches)),
            ("done", show(self.done)),
            ("running", show(self.running)),
            ("analysed, waiting for the writer", show(self.ingesting)),
            ("failed", show(self.failed)),
            ("pending", show(self.pending)),
            ("windows", f"{self.windows_done:,} of {show(self.windows)}"),
            ("windows/s", show(self.windows_per_s)),
            ("ETA", "-" if self.eta_s is None else _duration(self.eta_s)),
            ("writer backlog (messages, all runs)", show(self.backlog)),
        ]
        if self.parked:
            out.append(("messages parked (unreadable, all runs)", show(self.parked)))
        if self.writer is not None:
            out.append(("writer", self.writer))
        if self.workers is not None:
            out.append(("workers consuming", show(self.workers)))
        out += [("warning", w) for w in self.warnings]
        if self.error:
            out.append(("error", self.error))
        out += [(f"batch {b} (tried {a}×)", e) for b, a, e in self.errors]
        out += [(f"batch {x.batch}", x.describe()) for x in self.lost]
        return out


@dataclass
class LostInfo:
    """A batch whose worker stopped its heartbeat: ``silent_s`` since its last one."""

    batch: int
    worker: str  # host:pid
    silent_s: float
    requeued: bool  # False: noticed, the writer's sweep has not put its message back yet
    started: bool = True  # False: delivered to the worker, which died before starting it
    tries: int = 0  # the sweep's tries to put its message back (the broker failed at each)

    def describe(self) -> str:
        if self.requeued:
            then = "requeued"
        elif self.tries:
            then = f"its message not yet put back: tried {self.tries} time{'' if self.tries == 1 else 's'}"
        else:
            then = "requeued when the writer's sweep runs"
        before = "" if self.started else " before starting it"
        return f"lost on {self.worker}{before} {self.silent_s:.0f} s ago, {then}"


def run_status(store: Store, ref: str | int | None, client=None) -> RunReport:
    """``client``: a Redis client of the broker, or None (the database's counts only)."""
    from headatlas.service.storage import queue_store
    from headatlas.service.storage.db import database_id
    from headatlas.workers.ledger import RESTORE_PENDING, Ledger
    from headatlas.workers.policy import DELIVERY_GRACE_S

    with store.checked_read() as conn:
        run = queue_store.resolve_run(conn, ref, any_status=True)
        prog = queue_store.progress(conn, run.run_id)
        ledger = Ledger(client, database_id(conn)) if client is not None else None
    plan = prog.plan
    batches = plan.batches if plan else None
    windows = plan.windows if plan else None
    running = ingesting = backlog = parked = writer = workers = None
    lost: list[LostInfo] = []
    warnings: list[str] = []
    if ledger is not None:
        writer, workers, warnings = _consumers(ledger, run)
        backlog = ledger.backlog()
        parked = ledger.parked()
        if parked:
            warnings.append(
                f"{parked} message(s) on the ingest queue could not be read by the writer and are parked, nothing of "
                f"them stored (its log says why): `redis-cli LRANGE {PARKED} 0 -1` shows them"
            )
        if plan is not None:
            live = ledger.live(run.run_key)
            ingesting = live.ingesting
            t = time.time()
            silent = ledger.silent(run.run_key)
            running = live.running - len(silent)
            lost = [LostInfo(e.batch_id, e.worker, t - e.beat, False) for e in silent]
            lost += [
                LostInfo(e.batch_id, e.worker, t - e.beat, False, started=False)
                for e in ledger.unclaimed(run.run_key, DELIVERY_GRACE_S)
            ]
            lost += [
                LostInfo(
                    b,
                    x["worker"],
                    t - float(x["beat"]),
                    x.get("restore") != RESTORE_PENDING,  # absent: put back (recorded before there was one)
                    started=x.get("started", True),
                    tries=int(x.get("tries", 0)),
                )
                for b, x in sorted(ledger.lost(run.run_key).items())
            ]
    pending = None
    if batches is not None:
        pending = max(0, batches - prog.done - prog.failed - (running or 0) - (ingesting or 0))
    rate = eta = None
    if run.started_at is not None and prog.windows_done:
        end: datetime = run.finished_at or now()
        elapsed = (end - run.started_at).total_seconds()
        rate = prog.windows_done / elapsed if elapsed > 0 else None
        if rate and windows is not None and run.status == RunStatus.RUNNING:
            eta = max(0.0, (windows - prog.windows_done) / rate)
    return RunReport(
        run_id=run.run_id,
        name=run.name,
        status=run.status,
        batches=batches,
        done=prog.done,
        failed=prog.failed,
        running=running,
        ingesting=ingesting,
        pending=pending,
        windows_done=prog.windows_done,
        windows=windows,
        windows_per_s=rate,
        eta_s=eta,
        error=run.error,
        backlog=backlog,
        parked=parked,
        errors=prog.errors,
        lost=lost,
        writer=writer,
        workers=workers,
        warnings=warnings,
    )


def _consumers(ledger, run) -> tuple[str, int, list[str]]:
    """Who consumes what this run needs (the writer, the workers), and why it may not move."""
    from headatlas.workers.heartbeat import live_workers
    from headatlas.workers.lease import holder

    other, _raw = holder(ledger.r)
    workers = len(live_workers(ledger.r))
    active = run.status not in ENDED
    warnings = []
    if other is None:
        writer = "none"
        if active:
            warnings.append("no writer holds the ingest queue: nothing is stored; start `headatlas writer`")
    else:
        writer = f"{other.host}:{other.pid}, heartbeat {max(0.0, time.time() - other.beat):.0f} s ago"
        if other.database_id and other.database_id != ledger.database_id:
            writer = f"none for this database ({other.describe()})"
            if active:
                warnings.append(f"the writer on this broker stores into {other.db}: start a writer on this database")
    warnings += writer_pauses(ledger.r)
    orphans = ledger.r.hgetall(ledger.key(ORPHANS, "lake"))
    if orphans and int(orphans.get(b"files", 0)):
        seen = time.time() - float(orphans.get(b"at", 0))
        warnings.append(
            f"{int(orphans[b'files'])} uncatalogued data file(s) in the lake's data path, left by writes that failed "
            f"(counted by the writer {seen:.0f} s ago): `headatlas db compact` removes them once an hour old"
        )
    if active and workers == 0:
        warnings.append("no worker is consuming the analysis queue: nothing is analysed; start `headatlas worker`")
    lost_at = ledger.broker_lost(run.run_key) if active else None
    if lost_at is not None:
        warnings.append(
            f"the broker lost this run's queued batches {time.time() - lost_at:.0f} s ago (Redis restarted without "
            "its data): submit the same corpus again to queue what is not stored"
        )
    return writer, workers, warnings


def writer_pauses(client) -> list[str]:
    """What each paused writer of the broker waits for (its lake's catalogue or data path)."""
    from headatlas.workers.lease import paused_writers

    out = []
    for p in paused_writers(client):
        out.append(
            f"writer {p['host']}:{p['pid']} paused {max(0.0, time.time() - p['since']):.0f} s, waiting for "
            f"{p['waits_for']} ({p['cause']}): tried {p['tries']}×, next in {p['retry_s']:.1f} s; the analysed "
            "batches wait in Redis"
        )
    return out


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"
