"""Schedules in the database: add, edit, pause, remove, and the exactly-once claim of a fire.

Every change is one short write transaction (the file is held for milliseconds; a writer or a
reader holding it is waited for with ``retry_on_lock``, and the writer retries likewise). A fire
is claimed by inserting its (schedule, fire time) row: the primary key makes a second claim of
the same fire — a second beat process, a tick handled twice — a no-op. A lake has no keys: a
claim there also updates its schedule's row, so two concurrent claims of one schedule conflict
and the second, tried again, finds the fire taken.

A claimed fire is held under a lease (holder, until when) that its holder renews while it
submits; one left ``claimed`` past its lease (its process died) is taken over by the next claim
of its schedule. An ``only_new`` fire's documents are kept with the fire and count as sent only
when its run is submitted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import ParameterError
from headatlas.service.schedules import Cadence
from headatlas.service.storage import db

COLUMNS = (
    "schedule_id, name, corpus, model, dtype, batch_size, params, cron, every_s, timezone, enabled, "
    "only_new, anchor, last_fire, next_fire, created_at"
)


@dataclass(frozen=True)
class Schedule:
    schedule_id: int
    name: str
    corpus: str
    model: str
    dtype: str
    batch_size: int
    params: dict
    cron: str | None
    every_s: int | None
    timezone: str
    enabled: bool
    only_new: bool
    anchor: datetime
    last_fire: datetime | None
    next_fire: datetime
    created_at: datetime

    @classmethod
    def from_row(cls, row) -> Schedule:
        return cls(**db.record(row, json_fields=("params",)))

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.cron, self.every_s, self.timezone, self.anchor)


now = db.now
read = db.checked_read  # a read transaction on a database whose schema is current


def _write(path: str | Path):
    db.ensure_schema(path)
    return db.transaction(path)


def _get(conn: Connection, name: str) -> Schedule:
    row = conn.execute(text(f"SELECT {COLUMNS} FROM schedules WHERE name = :n"), {"n": name}).first()
    if row is None:
        known = [r[0] for r in conn.execute(text("SELECT name FROM schedules ORDER BY name"))]
        hint = f"known: {', '.join(known)}" if known else "none exists yet: add one with `headatlas schedule add`"
        raise ParameterError(f"no schedule named {name!r} ({hint})")
    return Schedule.from_row(row)


def get(conn: Connection, name: str) -> Schedule:
    return _get(conn, name)


def all_schedules(conn: Connection) -> list[Schedule]:
    return [Schedule.from_row(r) for r in conn.execute(text(f"SELECT {COLUMNS} FROM schedules ORDER BY name"))]


def add(
    path: str | Path,
    *,
    name: str,
    corpus: str,
    model: str,
    dtype: str,
    batch_size: int,
    params: dict,
    cadence: Cadence,
    only_new: bool,
    at: datetime | None = None,
) -> Schedule:
    """A new schedule, anchored at ``at`` (default: now; every ``at`` here is the caller's clock)."""
    t = (at or now()).replace(microsecond=0)
    cadence = Cadence(cadence.cron, cadence.every_s, cadence.timezone, t)
    values = {
        "name": name,
        "corpus": corpus,
        "model": model,
        "dtype": dtype,
        "bs": batch_size,
        "params": json.dumps(params),
        "cron": cadence.cron,
        "every": cadence.every_s,
        "tz": cadence.timezone,
        "only_new": only_new,
        "anchor": t,
        "next": cadence.next_after(t),
    }
    columns = (
        "name, corpus, model, dtype, batch_size, params, cron, every_s, timezone, enabled, only_new, anchor, "
        "next_fire, created_at"
    )
    given = ":name, :corpus, :model, :dtype, :bs, :params, :cron, :every, :tz, true, :only_new, :anchor, :next, :anchor"

    def work(conn: Connection) -> Schedule:
        keys = db.has_keys(conn)
        db.serialize(conn)  # a lake: two adds of one name take turns (no UNIQUE there)
        if conn.execute(text("SELECT count(*) FROM schedules WHERE name = :n"), {"n": name}).scalar():
            raise ParameterError(
                f"a schedule named {name!r} exists: choose another name, or change it with "
                f"`headatlas schedule edit {name}`"
            )
        if keys:
            row = conn.execute(
                text(f"INSERT INTO schedules ({columns}) VALUES ({given}) RETURNING {COLUMNS}"), values
            ).first()
            return Schedule.from_row(row)
        schedule_id = int(conn.execute(text("SELECT coalesce(max(schedule_id), 0) + 1 FROM schedules")).scalar_one())
        conn.execute(
            text(f"INSERT INTO schedules (schedule_id, {columns}) VALUES (:id, {given})"), {**values, "id": schedule_id}
        )
        return _get(conn, name)

    db.ensure_schema(path)
    return db.atomically(path, work)


def edit(path: str | Path, name: str, *, at: datetime | None = None, **changes) -> Schedule:
    """Change some fields; a new cadence starts from now, or ``at`` (its next fire is recomputed)."""
    changes = {k: v for k, v in changes.items() if v is not None}
    with _write(path) as conn:
        old = _get(conn, name)
        fields = {k: v for k, v in old.__dict__.items()}
        fields.update(changes)
        if "cron" in changes:
            fields["every_s"] = None
        if "every_s" in changes:
            fields["cron"] = None
        if {"cron", "every_s", "timezone"} & changes.keys():
            t = (at or now()).replace(microsecond=0)
            fields["anchor"] = t
            fields["next_fire"] = Cadence(fields["cron"], fields["every_s"], fields["timezone"], t).next_after(t)
        _update(
            conn,
            old.schedule_id,
            {
                k: fields[k]
                for k in (
                    "corpus",
                    "model",
                    "dtype",
                    "batch_size",
                    "params",
                    "cron",
                    "every_s",
                    "timezone",
                    "only_new",
                    "anchor",
                    "next_fire",
                )
            },
        )
        return _get(conn, name)


def set_enabled(path: str | Path, name: str, enabled: bool, *, at: datetime | None = None) -> Schedule:
    """Pause or resume. Resuming does not catch up the fires missed while paused: the next fire
    is the first scheduled time after now (or ``at``)."""
    with _write(path) as conn:
        old = _get(conn, name)
        values: dict[str, bool | datetime] = {"enabled": enabled}
        if enabled and not old.enabled:
            values["next_fire"] = old.cadence.next_after(at or now())
        _update(conn, old.schedule_id, values)
        return _get(conn, name)


def remove(path: str | Path, name: str) -> Schedule:
    """Delete the schedule and its record of fires; the runs it created stay."""
    with _write(path) as conn:
        old = _get(conn, name)
        for table in (
            "schedule_fire_documents",
            "schedule_fire_leases",
            "schedule_documents",
            "schedule_fires",
            "schedules",
        ):
            conn.execute(text(f"DELETE FROM {table} WHERE schedule_id = :s"), {"s": old.schedule_id})
        return old


def _update(conn: Connection, schedule_id: int, values: dict) -> None:
    if "params" in values and not isinstance(values["params"], str):
        values = dict(values, params=json.dumps(values["params"]))
    sets = ", ".join(f"{k} = :{k}" for k in values)
    conn.execute(
        text(f"UPDATE schedules SET {sets} WHERE schedule_id = :schedule_id"), dict(values, schedule_id=schedule_id)
    )


@dataclass(frozen=True)
class Claim:
    """A fire this caller now holds and must submit. ``doc_ids``: an ``only_new`` fire's
    documents, fixed at its first claim (None for a schedule that sends its whole corpus);
    ``resumed``: a fire another process claimed and left before its run was submitted (its lease
    ran out), taken over instead of the fire asked for, which stays due."""

    fire_time: datetime
    doc_ids: list[str] | None
    resumed: bool = False


@dataclass(frozen=True)
class InHand:
    fire_time: datetime
    holder: str
    lease_until: datetime | None  # None: claimed before fires had leases (by then long left)


def in_hand(conn: Connection, schedule_id: int) -> InHand | None:
    """The schedule's fire claimed and not yet finished, if any (at most one is in hand)."""
    row = conn.execute(
        text(
            "SELECT f.fire_time, coalesce(l.holder, ''), l.lease_until FROM schedule_fires f "
            "LEFT JOIN schedule_fire_leases l USING (schedule_id, fire_time) "
            "WHERE f.schedule_id = :s AND f.status = 'claimed' ORDER BY f.fire_time LIMIT 1"
        ),
        {"s": schedule_id},
    ).first()
    return None if row is None else InHand(row[0], row[1], row[2])


def held_elsewhere(hand: InHand | None, holder: str, at: datetime) -> bool:
    """Whether another live process holds the fire in hand (its lease has not run out)."""
    return hand is not None and hand.holder != holder and hand.lease_until is not None and hand.lease_until > at


def claim(
    path: str | Path,
    schedule_id: int,
    fire_time: datetime,
    *,
    kind: str,
    holder: str,
    lease_s: float,
    doc_ids: list[str] | None = None,
    at: datetime | None = None,
) -> Claim | None:
    """Claim a fire for ``holder`` until ``at + lease_s``: a Claim when this caller must submit a
    run, None when not. A scheduled fire is claimed only while the schedule exists, is enabled and
    the fire is not older than its next fire (a beat process working from a stale read cannot
    fire a tick already passed). While another fire of the schedule is in hand under a live lease,
    nothing is claimed (the fire stays due); one whose lease ran out is taken over first, with the
    documents it had. ``doc_ids`` (only_new): this fire's documents, kept with the fire until its
    run is submitted. ``at``: the claim's time (default now)."""
    claimed_at = at or now()
    lease = {"s": schedule_id, "holder": holder, "until": claimed_at + timedelta(seconds=lease_s)}

    def work(conn: Connection) -> Claim | None:
        db.serialize(conn)  # a lake: two claims of one database take turns (no keys there)
        row = conn.execute(text(f"SELECT {COLUMNS} FROM schedules WHERE schedule_id = :s"), {"s": schedule_id}).first()
        if row is None:
            return None
        sched = Schedule.from_row(row)
        hand = in_hand(conn, schedule_id)
        if hand is not None:
            if held_elsewhere(hand, holder, claimed_at):
                return None
            conn.execute(
                text("DELETE FROM schedule_fire_leases WHERE schedule_id = :s AND fire_time = :t"),
                {"s": schedule_id, "t": hand.fire_time},
            )
            conn.execute(
                text("INSERT INTO schedule_fire_leases VALUES (:s, :t, :holder, :until)"),
                dict(lease, t=hand.fire_time),
            )
            return Claim(hand.fire_time, _fire_documents(conn, schedule_id, hand.fire_time, sched.only_new), True)
        if kind == "scheduled" and (not sched.enabled or fire_time < sched.next_fire):
            return None
        keys = db.has_keys(conn)
        claim = {"s": schedule_id, "t": fire_time, "kind": kind, "now": claimed_at}
        if keys:
            inserted = conn.execute(
                text(
                    "INSERT INTO schedule_fires (schedule_id, fire_time, kind, claimed_at, status) "
                    "VALUES (:s, :t, :kind, :now, 'claimed') ON CONFLICT DO NOTHING RETURNING fire_time"
                ),
                claim,
            ).first()
            if inserted is None:
                return None
        else:
            taken = conn.execute(
                text("SELECT count(*) FROM schedule_fires WHERE schedule_id = :s AND fire_time = :t"), claim
            ).scalar()
            if taken:
                return None
            conn.execute(
                text(
                    "INSERT INTO schedule_fires (schedule_id, fire_time, kind, claimed_at, status) "
                    "VALUES (:s, :t, :kind, :now, 'claimed')"
                ),
                claim,
            )
        conn.execute(
            text("INSERT INTO schedule_fire_leases VALUES (:s, :t, :holder, :until)"), dict(lease, t=fire_time)
        )
        if doc_ids:
            _insert_ids(conn, "schedule_fire_documents", schedule_id, fire_time, sorted(set(doc_ids)))
        values = {"last_fire": max(fire_time, sched.last_fire or fire_time)}
        if kind == "scheduled":
            values["next_fire"] = sched.cadence.next_after(max(fire_time, claimed_at))
        _update(conn, schedule_id, values)
        return Claim(fire_time, list(doc_ids or []) if doc_ids is not None else None)

    return db.atomically(path, work)


def _fire_documents(conn: Connection, schedule_id: int, fire_time: datetime, only_new: bool) -> list[str] | None:
    if not only_new:
        return None
    return [
        r[0]
        for r in conn.execute(
            text("SELECT doc_id FROM schedule_fire_documents WHERE schedule_id = :s AND fire_time = :t"),
            {"s": schedule_id, "t": fire_time},
        )
    ]


def _insert_ids(conn: Connection, table: str, schedule_id: int, fire_time: datetime, doc_ids: list[str]) -> None:
    import pyarrow as pa

    raw = db.driver_connection(conn)
    raw.register("new_docs", pa.table({"doc_id": doc_ids}))
    try:
        raw.execute(f"INSERT INTO {table} SELECT ?, ?, doc_id FROM new_docs", [schedule_id, fire_time])
    finally:
        raw.unregister("new_docs")


def renew(path: str | Path, schedule_id: int, fire_time: datetime, *, holder: str, until: datetime) -> None:
    """Extend the holder's lease on a fire it is submitting (nothing when it lost the fire)."""
    with db.transaction(path) as conn:
        conn.execute(
            text(
                "UPDATE schedule_fire_leases SET lease_until = :until "
                "WHERE schedule_id = :s AND fire_time = :t AND holder = :holder"
            ),
            {"s": schedule_id, "t": fire_time, "holder": holder, "until": until},
        )


def finish_fire(
    path: str | Path,
    schedule_id: int,
    fire_time: datetime,
    *,
    status: str,
    run_key: str | None = None,
    run_name: str | None = None,
    documents: int | None = None,
    error: str | None = None,
) -> None:
    """Record a fire's outcome and release it. Its documents count as sent (never sent again)
    only when its run was submitted; after an error the next fire sends them. Fires that find
    no new document are recorded once per change of state: one that follows such a fire leaves
    no row of its own (an ``--every 1s`` schedule on a quiet folder would write one a second)."""
    key = {"s": schedule_id, "t": fire_time}

    def work(conn: Connection) -> None:
        if status == "no_new_documents" and _previous_status(conn, schedule_id, fire_time) == status:
            for table in ("schedule_fire_documents", "schedule_fire_leases", "schedule_fires"):
                conn.execute(text(f"DELETE FROM {table} WHERE schedule_id = :s AND fire_time = :t"), key)
            return
        conn.execute(
            text(
                "UPDATE schedule_fires SET status = :status, run_key = :key, run_name = :name, documents = :docs, "
                "error = :error WHERE schedule_id = :s AND fire_time = :t"
            ),
            dict(key, status=status, key=run_key, name=run_name, docs=documents, error=error),
        )
        if status == "submitted":
            conn.execute(
                text(
                    "INSERT INTO schedule_documents SELECT DISTINCT f.schedule_id, f.doc_id, f.fire_time "
                    "FROM schedule_fire_documents f WHERE f.schedule_id = :s AND f.fire_time = :t AND NOT EXISTS "
                    "(SELECT 1 FROM schedule_documents d WHERE d.schedule_id = :s AND d.doc_id = f.doc_id)"
                ),
                key,
            )
        for table in ("schedule_fire_documents", "schedule_fire_leases"):
            conn.execute(text(f"DELETE FROM {table} WHERE schedule_id = :s AND fire_time = :t"), key)

    db.atomically(path, work)


def _previous_status(conn: Connection, schedule_id: int, fire_time: datetime) -> str | None:
    """The outcome of the schedule's latest fire before ``fire_time`` (None: no earlier fire)."""
    return conn.execute(
        text(
            "SELECT status FROM schedule_fires WHERE schedule_id = :s AND fire_time < :t "
            "ORDER BY fire_time DESC LIMIT 1"
        ),
        {"s": schedule_id, "t": fire_time},
    ).scalar()


def seen_documents(conn: Connection, schedule_id: int) -> set[str]:
    return {
        r[0]
        for r in conn.execute(text("SELECT doc_id FROM schedule_documents WHERE schedule_id = :s"), {"s": schedule_id})
    }


def fires(conn: Connection, schedule_id: int) -> tuple[list[str], list[tuple]]:
    """A schedule's fires with their runs (the run's id and status once the writer created it),
    the newest first."""
    result = conn.execute(
        text(
            "SELECT f.fire_time, f.kind, f.status AS fire_status, f.documents, r.run_id, "
            "coalesce(r.name, f.run_name) AS run, r.status AS run_status, f.error "
            "FROM schedule_fires f LEFT JOIN runs r ON r.run_key = f.run_key "
            "WHERE f.schedule_id = :s ORDER BY f.fire_time DESC"
        ),
        {"s": schedule_id},
    )
    return list(result.keys()), [tuple(r) for r in result]
