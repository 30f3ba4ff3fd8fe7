"""The live side of a distributed run, kept in Redis next to the queues.

The database is the record of what is stored (batches done or failed, written by the writer
alone); Redis holds what only exists while a run is in flight: which batches are queued, which
one a worker is analysing (with a heartbeat), how many times each was tried, the last error,
and a copy of what the writer committed. Keys are per database and run key
(``headatlas:<database id>:<what>:<run_key>``): every process can address a run before the
writer has given it an id, and a new or replaced database file (a new id) inherits nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from headatlas.service.errors import BrokerError
from headatlas.service.statuses import ENDED, RunStatus
from headatlas.workers.messages import PARKED, BatchAnalysed, Message, encode, of_kind
from headatlas.workers.policy import BROKER_CONNECT_TIMEOUT_S, BROKER_READ_TIMEOUT_S

PREFIX = "headatlas"
INGEST = f"{PREFIX}:ingest"  # messages for the writer, oldest first (a Redis list)
PROCESSING = f"{PREFIX}:ingest:processing"  # taken by the writer, not yet committed
# taken by one of the further writers of a lake (PROCESSING:<writer token>), not yet committed
HELPER_PROCESSING = f"{PROCESSING}:"


def processing_lists(client: redis.Redis) -> list[str]:
    """Every list of messages taken by a writer and not committed: the first writer's, and each
    further writer's on a lake."""
    helpers = [k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(f"{HELPER_PROCESSING}*")]
    return [PROCESSING, *sorted(helpers)]


SHARED_TTL_S = 30 * 86400  # a run's shared values (Ledger.shared) outlive any run's queue
WRITER = f"{PREFIX}:writer"  # what the writer is doing now (status, tests)
ORPHANS = "orphans"  # key (+ "lake"): uncatalogued data files the writer saw after a data-path fault
WORKERS = f"{PREFIX}:workers:"  # + host:pid: a consuming worker process (its beacon), expiring unless refreshed

# A heartbeat refresh that only counts while the batch is still this worker's: a batch
# requeued as lost and started elsewhere must not be kept alive by the old process.
_BEAT = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local entry = cjson.decode(raw)
if entry.worker ~= ARGV[2] then return 0 end
entry.beat = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(entry))
redis.call('SET', KEYS[2], ARGV[2], 'EX', tonumber(ARGV[4]))
return 1
"""

# Declare a batch lost only if nothing changed since it was seen without a heartbeat (KEYS[2]:
# the batch's heartbeat key while it runs, its worker's beacon while it waits to start).
_LOSE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return 1
"""

# Replace a hash field only if it is still as it was read (ARGV[2]).
_SWAP = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"""

# What became of a lost batch's message (its lost record's ``restore``): not put back yet (the
# broker failed at the sweep's try; every sweep tries again), put back at the head of the queue,
# delivered again after the batch's last heartbeat (a live process holds it), or no longer
# unacknowledged (acknowledged, or put back by the visibility timeout or a pool).
RESTORE_PENDING, RESTORED, REDELIVERED, GONE = "pending", "restored", "redelivered", "gone"
RESTORES = (RESTORE_PENDING, RESTORED, REDELIVERED, GONE)

# Forget a delivery only if the entry is still this message's (another worker may have it now).
_UNDELIVER = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
if cjson.decode(raw).task ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""


# Mark batches queued unless the writer has stored them already: submit marks a chunk after
# sending it, and a fast worker and writer may store one of it first (it would stay "queued").
_MARK_QUEUED = """
for _, b in ipairs(ARGV) do
  if redis.call('SISMEMBER', KEYS[2], b) == 0 then redis.call('SADD', KEYS[1], b) end
end
return 0
"""


def connect(url: str, *, check: bool = True) -> redis.Redis:
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=BROKER_CONNECT_TIMEOUT_S,
        socket_timeout=BROKER_READ_TIMEOUT_S,
        health_check_interval=BROKER_READ_TIMEOUT_S,
    )
    if check:
        try:
            client.ping()
        except redis.RedisError as exc:
            from headatlas.workers.broker_errors import refusal

            refused = refusal(url, exc, kept="nothing was queued")
            if refused is not None:
                raise refused from None
            raise BrokerError(
                f"cannot reach the broker at {url} ({type(exc).__name__}): start Redis or set "
                "HEADATLAS_BROKER_URL; nothing was queued, submit again to resume"
            ) from None
    return client


def key(what: str, run_key: str, database_id: str) -> str:
    return f"{PREFIX}:{database_id}:{what}:{run_key}"


def _text(value: bytes | str) -> str:
    """A value read from Redis as text (bytes unless the client decodes responses)."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass
class Live:
    """Counts only Redis knows: batches queued (not yet stored or failed), running, analysed
    and waiting for the writer."""

    queued: int
    running: int
    ingesting: int
    done: int
    failed: int


@dataclass
class Running:
    """A batch a worker process has started: who, since when, its last heartbeat (epoch s).
    ``delivered``: not started yet, only delivered to the worker (``started`` and ``beat``: the
    delivery), which keeps it claimed by its beacon."""

    batch_id: int
    worker: str  # host:pid
    task_id: str
    started: float
    beat: float
    raw: bytes | str  # as stored, to act on it only if unchanged
    delivered: bool = False


def deleted_message(run_id: int) -> str:
    """What a waiting `submit --wait` says of a run deleted while in flight."""
    return (
        f"run {run_id} was deleted (`headatlas runs delete`) while it ran; its batches in flight were dropped: "
        "submit the corpus again to analyse it anew"
    )


def mark_runs_deleted(broker_url: str, database_id: str, runs: dict[str, int]) -> bool:
    """After `runs delete` of queued runs that may be in flight ({run key: run id}): their
    batches are dropped (``Ledger.mark_deleted``). False when the broker does not answer: a
    writer then finds out when it next stores one of their batches."""
    try:
        ledger = Ledger(connect(broker_url, check=False), database_id)
        for run_key, run_id in runs.items():
            ledger.mark_deleted(run_key, deleted_message(run_id))
        return True
    except redis.RedisError:
        return False


class Ledger:
    """The Redis state of one database's runs (``database_id``: its id, see migration 0005)."""

    def __init__(self, client: redis.Redis, database_id: str):
        self.r = client
        self.database_id = database_id

    def key(self, what: str, run_key: str) -> str:
        return key(what, run_key, self.database_id)

    # --- run description (written by submit, read by the writer to create the run) ----------
    def put_run(self, run_key: str, meta: dict) -> None:
        pipe = self.r.pipeline()
        if self.deleted(run_key):  # submitted again after `runs delete`: a new run
            pipe.hdel(self.key("run", run_key), "deleted", "error", "run_id")
        pipe.hset(self.key("run", run_key), mapping={"meta": json.dumps(meta)})
        pipe.delete(self.key("broker_lost", run_key))  # submitted (again): what is missing is queued
        pipe.sadd(self.key("active", "runs"), run_key)  # swept for lost workers until it ends
        pipe.execute()

    def run_meta(self, run_key: str) -> dict | None:
        raw = self.r.hget(self.key("run", run_key), "meta")
        return json.loads(raw) if raw else None

    def shared(self, run_key: str, what: str, compute: Callable[[], bytes], ttl_s: float = SHARED_TTL_S) -> bytes:
        """One value of a run that every worker must use alike (the reference means of mean
        ablation, SPEC §9): the value stored under ``what``, or, when there is none, ``compute()``
        stored if still absent (the first to store wins) and read back, so that every worker
        uses the same bytes whoever computed them."""
        name = self.key(what, run_key)
        found = self.r.get(name)
        if found is None:
            self.r.set(name, compute(), nx=True, ex=max(1, round(ttl_s)))
            found = self.r.get(name)
        if found is None:  # expired between the two calls: compute it again
            return self.shared(run_key, what, compute, ttl_s)
        return found if isinstance(found, bytes) else str(found).encode()

    def claim_batch_size(self, run_key: str, batch_size: int) -> int:
        """The run's batch size: the first submission's. Batch ids must keep naming the same
        windows whoever submits again, with whatever --batch-size."""
        self.r.hsetnx(self.key("run", run_key), "batch_size", batch_size)
        size = self.r.hget(self.key("run", run_key), "batch_size")
        if size is None:  # the run's hash vanished between the two calls (Redis flushed or restarted)
            raise BrokerError(f"run {run_key}: the broker lost its batch size; submit again")
        return int(size)

    def mark_broker_lost(self, run_key: str) -> None:
        """Redis lost this run's queued batches (restarted without its data): until the corpus
        is submitted again, `status` says so and `submit --wait` re-submits it."""
        self.r.set(self.key("broker_lost", run_key), f"{time.time():.3f}")

    def broker_lost(self, run_key: str) -> float | None:
        raw = self.r.get(self.key("broker_lost", run_key))
        return float(raw) if raw else None

    def set_run_id(self, run_key: str, run_id: int) -> None:
        self.r.hset(self.key("run", run_key), mapping={"run_id": run_id, "error": ""})

    def set_run_error(self, run_key: str, error: str) -> None:
        self.r.hset(self.key("run", run_key), "error", error)

    def mark_deleted(self, run_key: str, message: str) -> None:
        """The run was deleted from the database (`runs delete`) while it may still be in flight:
        writers drop its messages and never open it again, workers skip its batches, and a
        waiting `submit --wait` ends with ``message``, until the corpus is submitted again."""
        pipe = self.r.pipeline()
        pipe.hset(self.key("run", run_key), mapping={"deleted": f"{time.time():.3f}", "error": message})
        pipe.hdel(self.key("run", run_key), "status")
        for what in ("queued", "ingesting", "copy", "done", "failed", "lost"):
            pipe.delete(self.key(what, run_key))
        pipe.srem(self.key("active", "runs"), run_key)  # nothing of it is swept or queued again
        pipe.execute()

    def deleted(self, run_key: str) -> bool:
        return bool(self.r.hexists(self.key("run", run_key), "deleted"))

    def run_id(self, run_key: str) -> tuple[int | None, str]:
        run_id, error = self.r.hmget(self.key("run", run_key), ["run_id", "error"])
        return (int(run_id) if run_id else None), (_text(error) if error else "")

    # --- batches ------------------------------------------------------------------------------
    def queued(self, run_key: str) -> set[int]:
        return {int(b) for b in self.r.smembers(self.key("queued", run_key))}

    def done(self, run_key: str) -> set[int]:
        return {int(b) for b in self.r.smembers(self.key("done", run_key))}

    def failed(self, run_key: str) -> set[int]:
        """Batches the writer has recorded as failed (and not stored since)."""
        return {int(b) for b in self.r.smembers(self.key("failed", run_key))}

    def mark_queued(self, run_key: str, batch_ids: list[int]) -> None:
        """Batches just sent to the analysis queue, except those already stored."""
        if batch_ids:
            self.r.eval(_MARK_QUEUED, 2, self.key("queued", run_key), self.key("done", run_key), *batch_ids)

    def keep_copies(self, run_key: str, copies: dict[int, str]) -> None:
        """A copy of each batch's message body (JSON), kept until the batch is stored or failed:
        a batch whose message Redis lost (``stranded``) is queued again from it by the writer."""
        if copies:
            self.r.hset(self.key("copy", run_key), mapping={str(b): body for b, body in copies.items()})

    def copies(self, run_key: str, batch_ids: set[int]) -> dict[int, dict]:
        """The kept copies of ``batch_ids`` that exist (a batch submitted without one is absent)."""
        ids = sorted(batch_ids)
        raw = self.r.hmget(self.key("copy", run_key), ids) if ids else []
        return {b: json.loads(v) for b, v in zip(ids, raw, strict=True) if v is not None}

    def mark_done(self, run_key: str, batch_ids: set[int]) -> None:
        """Batches the database has stored (a Redis that lost its data learns them again)."""
        if batch_ids:
            self.r.sadd(self.key("done", run_key), *batch_ids)

    def reconcile_done(self, run_key: str, batch_ids: set[int]) -> None:
        """The database's stored batches, exactly: Redis forgets what the database does not hold
        (a database restored from an older copy keeps its id)."""
        pipe = self.r.pipeline()
        pipe.delete(self.key("done", run_key))
        if batch_ids:
            pipe.sadd(self.key("done", run_key), *batch_ids)
        pipe.execute()

    def in_flight(self, run_key: str) -> set[int]:
        """Batches queued for this database and neither stored nor failed yet: a message for
        each is in the analysis queue, running (with a heartbeat), or waiting for the writer."""
        pipe = self.r.pipeline()
        pipe.smembers(self.key("queued", run_key))
        pipe.hkeys(self.key("running", run_key))
        pipe.smembers(self.key("ingesting", run_key))
        pipe.smembers(self.key("done", run_key))
        queued, running, ingesting, done = pipe.execute()
        # a stored batch is never in flight again (a copy of it delivered later is skipped)
        return {int(b) for b in (*queued, *running, *ingesting)} - {int(b) for b in done}

    def stranded(self, run_key: str, queue: str = "analysis") -> set[int]:
        """Batches in flight that no message carries any more: the ledger has them queued, yet
        the analysis queue and the broker's unacknowledged deliveries are empty, no worker holds
        one delivered or running, and nothing waits for the writer. Redis shut down in the instant
        between a worker's pop of a message and its record of it loses that message; nothing
        would ever analyse the batch. Empty while any message is anywhere (a run still moving)."""
        pipe = self.r.pipeline()
        for name in (queue, *(f"{queue}\x06\x16{p}" for p in (1, 2, 3, 4, 5, 6, 7, 8, 9))):  # kombu's priorities
            pipe.llen(name)
        pipe.hlen("unacked")
        pipe.hlen(self.key("delivered", run_key))
        pipe.hlen(self.key("running", run_key))
        pipe.scard(self.key("ingesting", run_key))
        if any(int(n) for n in pipe.execute()) or self.backlog():
            return set()
        return self.in_flight(run_key)

    def unqueue(self, run_key: str, batch_ids: set[int]) -> None:
        """No longer queued (their messages are gone): a submission queues them again."""
        if batch_ids:
            self.r.srem(self.key("queued", run_key), *batch_ids)

    def forget(self, run_key: str, batch_id: int) -> None:
        """A message this database's writer will never store (it reached another database's
        writer): no longer in flight, so the next submission queues the batch again."""
        pipe = self.r.pipeline()
        for what in ("queued", "ingesting"):
            pipe.srem(self.key(what, run_key), batch_id)
        pipe.hdel(self.key("running", run_key), batch_id)
        pipe.hdel(self.key("delivered", run_key), batch_id)
        pipe.execute()

    def set_run_status(self, run_key: str, status: RunStatus, *, done: int, failed: int, windows: int) -> None:
        """What the database holds for the run, as the writer read it after committing."""
        self.r.hset(
            self.key("run", run_key),
            mapping={
                "status": RunStatus(status).value,
                "stored": done,
                "failed_stored": failed,
                "windows_done": windows,
            },
        )

    def run_status(self, run_key: str) -> RunStatus | None:
        raw = self.r.hget(self.key("run", run_key), "status")
        return RunStatus(_text(raw)) if raw else None

    def is_finished(self, run_key: str, batch_id: int) -> bool:
        return bool(self.r.sismember(self.key("done", run_key), str(batch_id)))  # as redis-py encodes an int

    def deliver(self, run_key: str, batch_id: int, worker: str, task_id: str) -> None:
        """A batch reached a worker process (``worker``: the consumer's host:pid), which may hold it
        a while before it starts (a prefetched message, a retry waiting for its countdown, a pool
        whose processes are busy or still starting). Until ``start``, the worker's beacon keeps the
        delivery claimed; a worker that dies before starting it has it requeued by the sweep
        (``unclaimed``), not left to the broker's visibility timeout."""
        t = time.time()  # unrounded: the sweep compares it with the broker's own delivery time
        entry = json.dumps({"worker": worker, "task": task_id, "started": t, "beat": t})
        pipe = self.r.pipeline()
        pipe.hset(self.key("delivered", run_key), batch_id, entry)
        pipe.sadd(self.key("active", "runs"), run_key)
        pipe.execute()

    def undeliver(self, run_key: str, batch_id: int, task_id: str) -> bool:
        """The batch will not start after all (already stored, or its worker stops and the broker
        connection gives the message back): forget the delivery of task ``task_id``, if it is
        still the one recorded."""
        return bool(self.r.eval(_UNDELIVER, 1, self.key("delivered", run_key), batch_id, task_id))

    def start(self, run_key: str, batch_id: int, worker: str, task_id: str, ttl_s: float) -> int:
        """A worker starts a batch: returns the attempt number (1 for the first try). The batch
        is running while its heartbeat key lives (``ttl_s``, refreshed by ``beat``)."""
        t = time.time()
        entry = json.dumps({"worker": worker, "task": task_id, "started": t, "beat": t})
        pipe = self.r.pipeline()
        pipe.hincrby(self.key("attempts", run_key), batch_id, 1)
        pipe.hdel(self.key("delivered", run_key), batch_id)  # from now on its own heartbeat keeps it
        pipe.hset(self.key("running", run_key), batch_id, entry)
        pipe.set(self.key("alive", f"{run_key}:{batch_id}"), worker, ex=max(1, round(ttl_s)))
        pipe.sadd(self.key("active", "runs"), run_key)
        return int(pipe.execute()[0])

    def beat(self, run_key: str, batch_id: int, worker: str, ttl_s: float) -> bool:
        """Refresh the heartbeat of a batch this worker runs; False when it is no longer its own."""
        return bool(
            self.r.eval(
                _BEAT,
                2,
                self.key("running", run_key),
                self.key("alive", f"{run_key}:{batch_id}"),
                batch_id,
                worker,
                f"{time.time():.3f}",
                max(1, round(ttl_s)),
            )
        )

    def running(self, run_key: str) -> list[Running]:
        return self._entries(run_key, "running")

    def waiting(self, run_key: str) -> list[Running]:
        """Batches delivered to a worker process and not started yet."""
        return self._entries(run_key, "delivered")

    def _entries(self, run_key: str, what: str) -> list[Running]:
        out = []
        for batch_id, raw in self.r.hgetall(self.key(what, run_key)).items():
            entry = json.loads(raw)
            out.append(
                Running(
                    int(batch_id),
                    entry["worker"],
                    entry.get("task", ""),
                    float(entry["started"]),
                    float(entry["beat"]),
                    raw,
                    delivered=what == "delivered",
                )
            )
        return sorted(out, key=lambda e: e.batch_id)

    def silent(self, run_key: str) -> list[Running]:
        """Running batches whose heartbeat has stopped: their worker is gone."""
        entries = self.running(run_key)
        if not entries:
            return []
        pipe = self.r.pipeline(transaction=False)
        for e in entries:
            pipe.exists(self.key("alive", f"{run_key}:{e.batch_id}"))
        return [e for e, alive in zip(entries, pipe.execute()) if not alive]

    def unclaimed(self, run_key: str, grace_s: float) -> list[Running]:
        """Delivered batches not started whose worker process is gone (its beacon expired), seen
        at least ``grace_s`` after their delivery (a beacon's first beat may trail it)."""
        entries = [e for e in self.waiting(run_key) if time.time() - e.started >= grace_s]
        if not entries:
            return []
        pipe = self.r.pipeline(transaction=False)
        for e in entries:
            pipe.exists(WORKERS + e.worker)
        return [e for e, alive in zip(entries, pipe.execute()) if not alive]

    def declare_lost(self, run_key: str, entry: Running) -> str | None:
        """Move a silent batch (running, or delivered and not started) to lost, unless it beat or
        changed meanwhile: the lost record as stored (its message not put back yet, ``restore``
        "pending"), or None."""
        record = json.dumps(
            {
                "worker": entry.worker,
                "beat": entry.beat,
                "requeued": time.time(),
                "started": not entry.delivered,
                "task": entry.task_id,
                "restore": RESTORE_PENDING,
                "tries": 0,
            }
        )
        held, alive = (
            (self.key("delivered", run_key), WORKERS + entry.worker)
            if entry.delivered
            else (self.key("running", run_key), self.key("alive", f"{run_key}:{entry.batch_id}"))
        )
        declared = bool(
            self.r.eval(
                _LOSE,
                3,
                held,
                alive,
                self.key("lost", run_key),
                entry.batch_id,
                entry.raw,
                record,
            )
        )
        return record if declared else None

    def lost(self, run_key: str) -> dict[int, dict]:
        """Batches declared lost because their worker was (until they are stored):
        {batch_id: {worker, beat (last heartbeat, epoch s), requeued (when declared lost, epoch s),
        started, task, restore (``RESTORES``; absent: put back, as before it was recorded), tries}}."""
        return {int(b): json.loads(v) for b, v in self.r.hgetall(self.key("lost", run_key)).items()}

    def pending_restores(self, run_key: str) -> list[tuple[int, str, dict]]:
        """Lost batches whose message is not put back yet, none stored: (batch id, the record as
        stored, the record)."""
        pipe = self.r.pipeline()
        pipe.hgetall(self.key("lost", run_key))
        pipe.smembers(self.key("done", run_key))
        records, done = pipe.execute()
        stored = {int(b) for b in done}
        out = []
        for b, raw in records.items():
            record = json.loads(raw)
            if record.get("restore") == RESTORE_PENDING and record.get("task") and int(b) not in stored:
                out.append((int(b), _text(raw), record))
        return sorted(out, key=lambda x: x[0])

    def record_restore(self, run_key: str, batch_id: int, raw: str, outcome: str, tries: int) -> bool:
        """The outcome of the ``tries``-th try to put a lost batch's message back, unless its lost
        record changed meanwhile (the batch stored, or lost again): False then."""
        record = {**json.loads(raw), "restore": outcome, "tries": tries}
        return bool(self.r.eval(_SWAP, 1, self.key("lost", run_key), batch_id, raw, json.dumps(record)))

    def active_runs(self) -> set[str]:
        return {_text(r) for r in self.r.smembers(self.key("active", "runs"))}

    def inactive(self, run_key: str) -> None:
        self.r.srem(self.key("active", "runs"), run_key)

    def settle(self, run_key: str) -> None:
        """A run that has ended with nothing of it in flight or delivered is no longer active
        (a copy of a stored batch delivered after the run ended made it active again; an active
        run keeps a writer from starting a new database at its path)."""
        if (
            self.run_status(run_key) in ENDED
            and not self.in_flight(run_key)
            and not self.r.hlen(self.key("delivered", run_key))
        ):
            self.inactive(run_key)

    def send(self, message: Message) -> None:
        """A message on the ingest queue, for the writer (workers/messages.py)."""
        self.r.rpush(INGEST, encode(message))

    def send_to_writer(self, kind: str, **fields) -> None:
        """The message of kind ``kind`` (open_run, ingest, failed, reopen, probe, series_step) with ``fields``,
        for this database (``messages.of_kind``)."""
        self.send(of_kind(kind, database_id=self.database_id, **fields))

    def analysed(self, run_key: str, batch_id: int, payload: str) -> None:
        """The result goes to the writer and the batch stops running, atomically."""
        pipe = self.r.pipeline()  # MULTI/EXEC
        pipe.rpush(INGEST, encode(BatchAnalysed(self.database_id, run_key, batch_id, payload)))
        pipe.hdel(self.key("running", run_key), batch_id)
        pipe.delete(self.key("alive", f"{run_key}:{batch_id}"))
        pipe.sadd(self.key("ingesting", run_key), batch_id)
        pipe.execute()

    def errored(self, run_key: str, batch_id: int, error: str) -> None:
        pipe = self.r.pipeline()
        pipe.hdel(self.key("running", run_key), batch_id)
        pipe.delete(self.key("alive", f"{run_key}:{batch_id}"))
        pipe.hset(self.key("errors", run_key), batch_id, error[:1000])
        pipe.execute()

    def last_error(self, run_key: str, batch_id: int) -> str | None:
        raw = self.r.hget(self.key("errors", run_key), batch_id)
        return _text(raw) if raw else None

    def finished(self, run_key: str, batch_id: int, *, failed: bool, windows: int = 0, pipe=None) -> None:
        """The writer has stored the batch (or its failure): it is no longer in flight.
        ``windows``: windows newly counted (0 for a redelivered batch)."""
        own = pipe is None
        pipe = self.r.pipeline() if own else pipe
        if windows:
            pipe.hincrby(self.key("run", run_key), "windows_done", windows)
        for what in ("queued", "ingesting"):
            pipe.srem(self.key(what, run_key), batch_id)
        pipe.hdel(self.key("running", run_key), batch_id)
        pipe.hdel(self.key("delivered", run_key), batch_id)
        pipe.hdel(self.key("lost", run_key), batch_id)
        pipe.hdel(self.key("copy", run_key), batch_id)
        pipe.sadd(self.key("failed" if failed else "done", run_key), batch_id)
        if not failed:
            pipe.srem(self.key("failed", run_key), batch_id)
        if own:
            pipe.execute()

    def reset_failed(self, run_key: str, batch_ids: list[int]) -> None:
        """Before a retry: the failed batches get a fresh attempt count."""
        if not batch_ids:
            return
        pipe = self.r.pipeline()
        pipe.srem(self.key("failed", run_key), *batch_ids)
        pipe.srem(self.key("queued", run_key), *batch_ids)
        pipe.hdel(self.key("attempts", run_key), *batch_ids)
        pipe.hdel(self.key("errors", run_key), *batch_ids)
        pipe.execute()

    def windows_done(self, run_key: str) -> int:
        return int(self.r.hget(self.key("run", run_key), "windows_done") or 0)

    def backlog(self) -> int:
        """Messages waiting for the writer (all runs)."""
        return int(self.r.llen(INGEST)) + sum(int(self.r.llen(name)) for name in processing_lists(self.r))

    def parked(self) -> int:
        """Messages the writer could not read and parked (all runs, every database)."""
        return int(self.r.llen(PARKED))

    def live(self, run_key: str) -> Live:
        pipe = self.r.pipeline()
        pipe.scard(self.key("queued", run_key))
        pipe.hlen(self.key("running", run_key))
        pipe.scard(self.key("ingesting", run_key))
        pipe.scard(self.key("done", run_key))
        pipe.scard(self.key("failed", run_key))
        return Live(*(int(x) for x in pipe.execute()))

    # --- the writer's current work (for status, and for tests that stop it mid-ingest) --------
    def writer_state(self, state: str, **fields) -> None:
        self.r.hset(
            WRITER, mapping={"state": state, "since": f"{time.time():.3f}", **{k: str(v) for k, v in fields.items()}}
        )
