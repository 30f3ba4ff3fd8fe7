"""Who stores what: the writer's lease on the ingest queue, and the database a submission is for.

A broker has one ingest queue and one writer consuming it. The writer holds a lease: a Redis key
naming its database (file and id), host and pid, that expires unless a thread refreshes it. A
second writer refuses to start while the lease lives, with a one-line error naming the first
one's database; a submitter learns from the lease which database its batches are for.

A lake takes many writers (several processes, on several hosts, commit at once): a writer of the
same lake finds the lease held by a writer that shares it and joins as a further writer, with a
key of its own (``headatlas:writer:helper:<token>``, expiring like the lease) and a processing
list of its own. A writer whose key expired (killed) leaves its list to the others, who put the
messages back on the queue.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from headatlas.service.errors import StoreError, WriterConflict
from headatlas.workers.policy import HEARTBEAT_S, SILENT_S, WRITER_POLL_S

LEASE = "headatlas:writer:lease"
HELPER = "headatlas:writer:helper:"  # + token: a further writer of a lake, alive while the key lives
PAUSED = "headatlas:writer:paused:"  # + token: what a paused writer waits for (status), expiring unless refreshed
LAST = "headatlas:writer:last"  # the database the last writer stored into (no expiry)
EPOCH = "headatlas:epoch"  # a random value set once: a new one means Redis lost its data


# Refresh only our own lease: after a stall long enough for another writer to take over, the
# stalled one must find out, not take the queue back.
_REFRESH = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local lease = cjson.decode(raw)
if lease.token ~= ARGV[1] then return 0 end
lease.beat = tonumber(ARGV[2])
if ARGV[3] ~= '' then lease.database_id = ARGV[3] end
redis.call('SET', KEYS[1], cjson.encode(lease), 'PX', tonumber(ARGV[4]))
return 1
"""

_TAKE_OVER = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
return 1
"""

_RELEASE = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw).token == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


@dataclass(frozen=True)
class Holder:
    """The writer holding the ingest queue."""

    db: str
    database_id: str | None  # None while it is still opening its database
    host: str
    pid: int
    beat: float  # last refresh, epoch seconds
    token: str
    shared: bool = False  # a lake's writer: further writers of the same lake may join it

    def describe(self) -> str:
        ident = f"database {self.database_id[:8]}" if self.database_id else "database being opened"
        return f"{self.db} ({ident}), written by {self.host}:{self.pid}"


def holder(client: redis.Redis) -> tuple[Holder | None, bytes | str | None]:
    """The writer holding the lease and the lease as stored (both None when no writer holds it)."""
    raw = client.get(LEASE)
    if raw is None:
        return None, None
    data = json.loads(raw)
    return Holder(
        data["db"],
        data.get("database_id"),
        data["host"],
        int(data["pid"]),
        float(data["beat"]),
        data["token"],
        bool(data.get("shared", False)),
    ), raw


def helpers(client: redis.Redis) -> list[Holder]:
    """The further writers of a lake, alive."""
    out = []
    for name in client.scan_iter(f"{HELPER}*"):
        raw = client.get(name)
        if raw:
            data = json.loads(raw)
            out.append(
                Holder(
                    data["db"],
                    data.get("database_id"),
                    data["host"],
                    int(data["pid"]),
                    float(data["beat"]),
                    data["token"],
                    True,
                )
            )
    return out


def paused_writers(client: redis.Redis) -> list[dict]:
    """The writers waiting for their database to come back (``WriterLease.say_paused``): each a
    dict with host, pid, waits_for, cause, since (epoch seconds), retry_s, tries."""
    out = []
    for name in client.scan_iter(f"{PAUSED}*"):
        raw = client.get(name)
        if raw:
            out.append(json.loads(raw))
    return sorted(out, key=lambda p: p.get("since", 0.0))


class WriterLease:
    """``shared``: the database takes several writers (a lake with a PostgreSQL catalogue); the
    lease then admits further writers of the same database (``helper``)."""

    def __init__(self, client: redis.Redis, db: str | Path, broker_url: str, *, shared: bool = False):
        from headatlas.service.storage.backends import open_backend

        backend = open_backend(db)
        # a file by its absolute path; a lake by its URL, shown without a password
        where = str(Path(db).resolve()) if backend.kind == "file" else backend.label
        self.r, self.db, self.broker_url = client, where, broker_url
        self.token = uuid.uuid4().hex
        self.database_id: str | None = None
        self.shared = shared
        self.helper = False  # True: a further writer of a lake whose lease another writer holds
        # when this writer last refreshed its lease, and whether Redis refused a refresh since:
        # what tells, when the lease is found gone, why (``why_vanished``)
        self._refreshed = time.monotonic()
        self._redis_failed = False

    def _value(self) -> str:
        return json.dumps(
            {
                "db": self.db,
                "database_id": self.database_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "beat": time.time(),
                "token": self.token,
                "shared": self.shared,
            }
        )

    def acquire(self) -> None:
        """Take the ingest queue, or raise WriterConflict naming the writer that holds it."""
        ttl = int(SILENT_S * 1000)
        self._refreshed = time.monotonic()
        if self.r.set(LEASE, self._value(), nx=True, px=ttl):
            return
        other, raw = holder(self.r)
        if other is not None and _left_behind(other):
            assert raw is not None  # holder() returns both or neither
            # a writer of this machine that no longer runs (killed): no need to wait for expiry
            if self.r.eval(_TAKE_OVER, 1, LEASE, raw, self._value(), ttl):
                return
        other, _raw = holder(self.r)
        if other is None:  # expired meanwhile
            return self.acquire()
        if self.shared and other.shared and other.db == self.db:
            self.helper = True  # one more writer of the same lake
            self.r.set(self.helper_key, self._value(), px=ttl)
            return
        age = max(0.0, time.time() - other.beat)
        raise WriterConflict(
            f"the ingest queue of {self.broker_url} is held by another live writer: {other.describe()}, "
            f"heartbeat {age:.0f} s ago; stop that writer first, or give this database its own broker "
            "(--broker, e.g. another Redis database number)"
        )

    def say_paused(self, waits_for: str, cause: str, since: float, retry_s: float, tries: int) -> None:
        """Tell `status` what this writer waits for, until ``clear_paused`` (or it stops saying so)."""
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "waits_for": waits_for,
            "cause": cause,
            "since": since,
            "retry_s": retry_s,
            "tries": tries,
        }
        self.r.set(f"{PAUSED}{self.token}", json.dumps(record), px=int((retry_s + SILENT_S) * 1000))

    def clear_paused(self) -> None:
        self.r.delete(f"{PAUSED}{self.token}")

    @property
    def helper_key(self) -> str:
        return f"{HELPER}{self.token}"

    def reclaim(self) -> bool:
        """Take the lease again after it vanished (``why_vanished``): True when it is ours again,
        False when another writer holds it."""
        sent = time.monotonic()  # as for refresh: from when it was asked
        taken = bool(self.r.set(LEASE, self._value(), nx=True, px=int(SILENT_S * 1000)))
        if taken:
            self._refreshed, self._redis_failed = sent, False
        return taken

    def why_vanished(self) -> str:
        """Why the lease is gone, for the log, from what this writer saw: Redis refused a refresh
        since the last one that passed (Redis was away), or none was tried for the lease's life
        (this writer was silent: its process stopped or starved of CPU), or neither (Redis lost
        its data). A writer pausing for its database (a lake's catalogue away) keeps refreshing:
        that pause is none of these."""
        silent = time.monotonic() - self._refreshed
        if self._redis_failed:
            return f"Redis was away: no refresh reached it for {silent:.1f} s, the lease lives {SILENT_S:g} s"
        if silent >= SILENT_S:
            return (
                f"this writer refreshed it {silent:.1f} s ago, past the {SILENT_S:g} s it lives, with Redis answering: "
                "its process was stopped or starved of CPU"
            )
        return "Redis lost its data (restarted without it, or flushed)"

    def last(self) -> dict | None:
        """The database the last writer on this broker stored into: {db, database_id}."""
        raw = self.r.get(LAST)
        return json.loads(raw) if raw else None

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Refresh the lease from a thread while the block runs: opening a database (creating or
        upgrading its schema) can take longer than the lease lives on a loaded machine, and a
        lease that expired meanwhile would read as taken by another writer."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    self.refresh()
                except redis.RedisError:
                    pass  # the broker is away: set_database finds out, or the keeper later

        thread = threading.Thread(target=beat, name="writer-lease-opening", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def set_database(self, database_id: str) -> None:
        self.database_id = database_id
        self.r.set(LAST, json.dumps({"db": self.db, "database_id": database_id}))
        if not self.refresh() and not self.reclaim():  # vanished (Redis away meanwhile): ours again
            raise WriterConflict(
                f"this writer lost the ingest queue of {self.broker_url} while opening {self.db}: "
                "another writer took it; stop one of them"
            )

    def refresh(self) -> bool:
        """False when the lease is no longer ours (a further writer's key is simply renewed). The
        refresh counts from when it was sent, not from its answer: a writer stopped with a refresh
        in flight (SIGSTOP, a host starved of CPU) reads the answer only when it runs again, and
        counted from then the lease, expired meanwhile, would seem to have vanished while this
        writer was not silent (``why_vanished`` said Redis lost its data)."""
        sent = time.monotonic()
        try:
            if self.helper:
                self.r.set(self.helper_key, self._value(), px=int(SILENT_S * 1000))
                self._refresh_lease()  # the lease too, once this writer took it over
                ours = True
            else:
                ours = self._refresh_lease()
        except redis.RedisError:
            self._redis_failed = True
            raise
        if ours:
            self._refreshed, self._redis_failed = sent, False
        return ours

    def take_over(self) -> bool:
        """A further writer takes the lease of a first writer that is gone (its lease expired),
        so that status and submitters see a writer; it keeps its own processing list."""
        return bool(self.r.set(LEASE, self._value(), nx=True, px=int(SILENT_S * 1000)))

    def _refresh_lease(self) -> bool:
        return bool(
            self.r.eval(
                _REFRESH, 1, LEASE, self.token, f"{time.time():.3f}", self.database_id or "", int(SILENT_S * 1000)
            )
        )

    def release(self) -> None:
        if self.helper:
            self.r.delete(self.helper_key)
        self.r.eval(_RELEASE, 1, LEASE, self.token)


def broker_epoch(client: redis.Redis) -> str:
    """This Redis's epoch: a random value set by the first process that asks. It survives a
    restart with persistence; a Redis that lost its data (restarted without it, flushed) has a
    new one, which tells every process that the queues and the live state are gone."""
    value = client.get(EPOCH)
    if value is None:
        client.set(EPOCH, uuid.uuid4().hex, nx=True)
        value = client.get(EPOCH)
    return value.decode() if isinstance(value, bytes) else str(value)


def _left_behind(other: Holder) -> bool:
    """A lease left by a process of this machine that is gone (or by this very process)."""
    if other.host != socket.gethostname():
        return False
    if other.pid == os.getpid():
        return True
    try:
        os.kill(other.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def target_database(client: redis.Redis, db: str, broker_url: str, wait_s: float) -> str:
    """The id of the database a submission's batches are for.

    The live writer's database when one holds the ingest queue (``db``, when readable here,
    must be that same database); else ``db`` read from here (the batches wait for its writer).
    With neither, wait up to ``wait_s`` for a writer to start."""
    from headatlas.service.storage.backends import open_backend
    from headatlas.service.storage.db import read_database_id

    backend = open_backend(db)
    local = read_database_id(backend) if backend.exists() else None
    deadline = time.monotonic() + wait_s
    while True:
        other, _raw = holder(client)
        if other is not None and other.database_id:
            if local is not None and local != other.database_id:
                raise WriterConflict(
                    f"--db {backend.label} is database {local[:8]}, but the writer on {broker_url} stores into "
                    f"{other.describe()}: pass --db {other.db}, or stop that writer and start one on {backend.label}; "
                    "nothing was queued"
                )
            return other.database_id
        if local is not None and other is None:
            return local
        if time.monotonic() >= deadline:
            raise StoreError(
                f"no writer holds the ingest queue of {broker_url} and there is no database at {backend.label} to read here: "
                "start `headatlas writer` on this broker (it creates the database), or pass --db; nothing was queued"
            )
        time.sleep(WRITER_POLL_S)
