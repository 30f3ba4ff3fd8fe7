"""Store operations of distributed runs: the batch plan, failed batches, the end of a run.

Called by the writer only (the one process that writes the database while a queue runs); the
read helpers (``plan_of``, ``progress``) also serve ``headatlas status`` on a read connection.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import RunDeleted, RunNotFound, StoreError
from headatlas.service.statuses import BatchStatus, RunStatus, sql
from headatlas.service.storage import db
from headatlas.service.storage.runs import Run, now, resolve_run, run_columns, run_is_there
from headatlas.service.storage.series_rows import add_step, ensure_series
from headatlas.service.storage.store import Store

DONE, FAILED = sql(BatchStatus.DONE), sql(BatchStatus.FAILED)


@dataclass(frozen=True)
class Plan:
    run_id: int
    batch_size: int
    batches: int | None  # None while the submitter is still cutting the corpus
    windows: int | None


@dataclass(frozen=True)
class Progress:
    """What the database knows of a queued run: batches done and failed, windows counted."""

    plan: Plan | None
    done: int
    failed: int
    windows_done: int
    errors: list[tuple[int, int, str]]  # (batch_id, attempts, error) of failed batches


@dataclass(frozen=True)
class Summary:
    """A queued run as the database holds it: its status, batches stored and failed, windows."""

    status: RunStatus
    done: int
    failed: int
    windows: int


def summary(conn: Connection, run_id: int) -> Summary:
    status = conn.execute(text("SELECT status FROM runs WHERE run_id = :r"), {"r": run_id}).scalar()
    if status is None:
        raise StoreError(f"no run {run_id} in the database")
    done, failed = _counts(conn, run_id)
    windows = conn.execute(
        text(f"SELECT coalesce(sum(n_windows), 0) FROM batches WHERE run_id = :r AND status = {DONE}"), {"r": run_id}
    ).scalar_one()
    return Summary(RunStatus(status), done, failed, int(windows))


def stored_batches(conn: Connection, run_id: int) -> set[int]:
    return {
        r[0]
        for r in conn.execute(
            text(f"SELECT batch_id FROM batches WHERE run_id = :r AND status = {DONE}"), {"r": run_id}
        )
    }


def find_run_by_key(conn: Connection, run_key: str) -> Run | None:
    row = conn.execute(text(f"SELECT {run_columns(conn)} FROM runs WHERE run_key = :k"), {"k": run_key}).first()
    return Run.from_row(row) if row is not None else None


def open_run(store: Store, meta: dict, *, opened: int | None = None) -> tuple[Run, Plan]:
    """Create the queued run described by ``meta`` (or find it) and record its batch plan.

    ``meta``: run_key, name, corpus, corpus_fingerprint, model (describe()), params, device,
    batch_size, batches, windows; ``series`` (name, checkpoints, step, checkpoint) where the run is
    a checkpoint of a training series, recorded in the plan's transaction (``series_rows.add_step``).
    A run already planned keeps its plan. ``opened``: the id a writer already gave the run; it is
    never created again. ``RunDeleted`` when the run is no longer in the database (`runs delete`
    came first, or between this function's transactions).
    """
    if opened is None:
        run, _ = store.find_or_create_run(
            run_key=meta["run_key"],
            name=meta["name"],
            corpus=meta["corpus"],
            corpus_fingerprint=meta["corpus_fingerprint"],
            model=meta["model"],
            params=meta["params"],
            engine="queue",
            device=meta.get("device"),
        )
    else:
        with store.read() as conn:
            found = find_run_by_key(conn, meta["run_key"])
        if found is None or found.run_id != opened:
            raise RunDeleted(opened)
        run = found

    def work(conn: Connection) -> Plan | None:
        db.serialize(conn)  # on a lake, two writers opening the run record one plan
        if not run_is_there(conn, run.run_id, run.run_key, hold=True):  # a delete between the two
            raise RunDeleted(run.run_id)
        plan = plan_of(conn, run.run_id)
        if plan is None:
            conn.execute(
                text(
                    "INSERT INTO queue_plans (run_id, batch_size, batches, windows, submitted_at) "
                    "VALUES (:r, :bs, :b, :w, :ts)"
                ),
                {"r": run.run_id, "bs": meta["batch_size"], "b": meta["batches"], "w": meta["windows"], "ts": now()},
            )
        elif plan.batches is None and meta.get("batches") is not None:
            conn.execute(
                text("UPDATE queue_plans SET batches = :b, windows = :w WHERE run_id = :r"),
                {"r": run.run_id, "b": meta["batches"], "w": meta["windows"]},
            )
        plan = plan_of(conn, run.run_id)
        if meta.get("series") is not None:  # a checkpoint of a training series (submit --checkpoints)
            add_series_step(conn, run.run_id, meta["series"])
        startable = (RunStatus.CREATED, RunStatus.INTERRUPTED)
        if run.status in startable:
            conn.execute(
                text(
                    f"UPDATE runs SET status = {sql(RunStatus.RUNNING)}, started_at = coalesce(started_at, :ts), "
                    f"error = NULL WHERE run_id = :r AND status IN {sql(*startable)}"
                ),
                {"ts": now(), "r": run.run_id},
            )
        finish_if_complete(conn, run.run_id)
        return plan

    plan = store.atomically(work)
    assert plan is not None  # recorded above when missing
    if not store.backend.keys and plan.batches is not None:
        # a lake: another writer may have committed the run's last batch while this transaction
        # recorded the plan; each saw the other's part missing (docs/architecture.md, "Ending a run")
        store.atomically(lambda conn: finish_if_complete(conn, run.run_id))
    try:
        return store.get_run(run.run_id), plan
    except RunNotFound:
        raise RunDeleted(run.run_id) from None


def add_series_step(conn: Connection, run_id: int, series: dict) -> None:
    """Record ``run_id`` in a training series as ``series`` (name, checkpoints, step, checkpoint)
    describes it: the series made when it is new, the step replaced when it held another run."""
    found = ensure_series(conn, series["name"], series["checkpoints"])
    add_step(conn, found, int(series["step"]), series["checkpoint"], run_id)


def plan_of(conn: Connection, run_id: int) -> Plan | None:
    row = conn.execute(
        text("SELECT run_id, batch_size, batches, windows FROM queue_plans WHERE run_id = :r"), {"r": run_id}
    ).first()
    return Plan(*row) if row is not None else None


def mark_failed(conn: Connection, run_id: int, batch_id: int, *, attempts: int, error: str) -> bool:
    """Record a batch that failed ``attempts`` times, never over a batch already stored.
    Returns False when the batch is stored."""
    status = conn.execute(
        text("SELECT status FROM batches WHERE run_id = :r AND batch_id = :b"), {"r": run_id, "b": batch_id}
    ).scalar()
    if status == BatchStatus.DONE:
        return False
    values = {"r": run_id, "b": batch_id, "a": attempts, "e": error[:1000]}
    if db.has_keys(conn):
        conn.execute(
            text(
                "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts, error) "
                f"VALUES (:r, :b, 0, {FAILED}, :a, :e) ON CONFLICT (run_id, batch_id) DO UPDATE SET "
                f"status = {FAILED}, attempts = excluded.attempts, error = excluded.error"
            ),
            values,
        )
        return True
    # a lake: the batch's other rows give way to one failed row (and a concurrent store of the
    # batch, which deletes them too, conflicts with this)
    conn.execute(text(f"DELETE FROM batches WHERE run_id = :r AND batch_id = :b AND status <> {DONE}"), values)
    conn.execute(
        text(
            "INSERT INTO batches (run_id, batch_id, n_windows, status, attempts, error) "
            f"VALUES (:r, :b, 0, {FAILED}, :a, :e)"
        ),
        values,
    )
    return True


def reopen_failed(store: Store, run_id: int) -> list[int]:
    """Forget the failed batches of a run so they count as pending again; the run is running."""

    def work(conn: Connection) -> list[int]:
        ids = [
            r[0]
            for r in conn.execute(
                text(f"SELECT DISTINCT batch_id FROM batches WHERE run_id = :r AND status = {FAILED}"), {"r": run_id}
            )
        ]
        conn.execute(text(f"DELETE FROM batches WHERE run_id = :r AND status = {FAILED}"), {"r": run_id})
        conn.execute(
            text(
                f"UPDATE runs SET status = {sql(RunStatus.RUNNING)}, error = NULL, finished_at = NULL "
                f"WHERE run_id = :r AND status <> {sql(RunStatus.DONE)}"
            ),
            {"r": run_id},
        )
        return sorted(ids)

    return store.atomically(work)


def finish_if_complete(conn: Connection, run_id: int) -> None:
    """End the run once every planned batch is either stored or failed: ``done`` when none
    failed, ``failed`` (with the count and the fix in ``error``) otherwise."""
    plan = plan_of(conn, run_id)
    if plan is None or plan.batches is None:
        return
    done, failed = _counts(conn, run_id)
    if done + failed < plan.batches:
        return
    if failed:
        status, error = (
            RunStatus.FAILED,
            f"{failed} batch(es) failed: see `headatlas status {run_id}`, then `headatlas retry {run_id}`",
        )
    else:
        status, error = RunStatus.DONE, None
    ended = conn.execute(
        text("SELECT count(*) FROM runs WHERE run_id = :r AND status = :s AND finished_at IS NOT NULL"),
        {"r": run_id, "s": status.value},
    ).scalar()
    if ended:  # already ended so (and compacted): every writer of a lake asks after its commits
        return
    conn.execute(
        text(
            "UPDATE runs SET status = :s, error = :e, finished_at = :ts, "
            "wall_s = epoch(CAST(:ts AS TIMESTAMP)) - epoch(coalesce(started_at, created_at)) "
            "WHERE run_id = :r AND (status <> :s OR finished_at IS NULL)"
        ),
        {"s": status.value, "e": error, "ts": now(), "r": run_id},
    )
    if status == RunStatus.DONE:
        from headatlas.service.storage.compact import compact_run

        compact_run(conn, run_id)  # same transaction: the views read few rows from now on


def progress(conn: Connection, run_id: int, *, max_errors: int = 5) -> Progress:
    done, failed = _counts(conn, run_id)
    windows = conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run_id}).scalar_one()
    errors = [
        tuple(r)
        for r in conn.execute(
            text(
                f"SELECT batch_id, attempts, error FROM batches WHERE run_id = :r AND status = {FAILED} "
                "ORDER BY batch_id LIMIT :n"
            ),
            {"r": run_id, "n": max_errors},
        )
    ]
    return Progress(plan_of(conn, run_id), done, failed, int(windows), errors)


def run_and_plan(store: Store, ref: str | int | None) -> tuple[Run, Plan]:
    with store.checked_read() as conn:
        run = resolve_run(conn, ref)
        plan = plan_of(conn, run.run_id)
    if plan is None:
        raise StoreError(
            f"run {run.run_id} ({run.name}) was not submitted to the queue: re-run `headatlas analyze` to resume it"
        )
    return run, plan


def _counts(conn: Connection, run_id: int) -> tuple[int, int]:
    """(batches stored, batches failed and not stored). A lake's ledger may hold more than one
    row of a batch for a moment (a failure recorded beside a concurrent store): a stored batch
    counts as stored only."""
    row = conn.execute(
        text(
            f"WITH b AS (SELECT batch_id, bool_or(status = {DONE}) AS done, bool_or(status = {FAILED}) AS failed "
            "FROM batches WHERE run_id = :r GROUP BY batch_id) "
            "SELECT count(*) FILTER (WHERE done), count(*) FILTER (WHERE failed AND NOT done) FROM b"
        ),
        {"r": run_id},
    ).one()  # an aggregate: always one row
    return int(row[0]), int(row[1])
