"""The live side of a distributed run, kept in Redis next to the queues.

The database is the record of what is stored (batches done or failed, written by the writer
alone); Redis holds what only exists while a run is in flight: which batches are queued, which
one a worker is analysing, how many times each was tried, the last error. Keys are per run key
(``headatlas:<what>:<run_key>``), so every process can address a run before the writer has
given it an id.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import redis

from service.errors import BrokerError

PREFIX = "headatlas"
INGEST = f"{PREFIX}:ingest"  # messages for the writer, oldest first (a Redis list)
PROCESSING = f"{PREFIX}:ingest:processing"  # taken by the writer, not yet committed


def connect(url: str, *, check: bool = True) -> redis.Redis:
    client = redis.Redis.from_url(url, socket_connect_timeout=5, socket_timeout=30, health_check_interval=30)
    if check:
        try:
            client.ping()
        except redis.RedisError as exc:
            raise BrokerError(
                f"cannot reach the broker at {url} ({type(exc).__name__}): start Redis or set "
                "HEADATLAS_BROKER_URL; nothing was queued, submit again to resume"
            ) from None
    return client


def key(what: str, run_key: str) -> str:
    return f"{PREFIX}:{what}:{run_key}"


@dataclass
class Live:
    """Counts only Redis knows: batches queued (not yet stored or failed), running, analysed
    and waiting for the writer."""

    queued: int
    running: int
    ingesting: int
    done: int
    failed: int


class Ledger:
    def __init__(self, client: redis.Redis):
        self.r = client

    # --- run description (written by submit, read by the writer to create the run) ----------
    def put_run(self, run_key: str, meta: dict) -> None:
        self.r.hset(key("run", run_key), mapping={"meta": json.dumps(meta)})

    def run_meta(self, run_key: str) -> dict | None:
        raw = self.r.hget(key("run", run_key), "meta")
        return json.loads(raw) if raw else None

    def claim_batch_size(self, run_key: str, batch_size: int) -> int:
        """The run's batch size: the first submission's. Batch ids must keep naming the same
        windows whoever submits again, with whatever --batch-size."""
        self.r.hsetnx(key("run", run_key), "batch_size", batch_size)
        return int(self.r.hget(key("run", run_key), "batch_size"))

    def set_run_id(self, run_key: str, run_id: int) -> None:
        self.r.hset(key("run", run_key), mapping={"run_id": run_id, "error": ""})

    def set_run_error(self, run_key: str, error: str) -> None:
        self.r.hset(key("run", run_key), "error", error)

    def run_id(self, run_key: str) -> tuple[int | None, str]:
        run_id, error = self.r.hmget(key("run", run_key), ["run_id", "error"])
        return (int(run_id) if run_id else None), (error.decode() if error else "")

    # --- batches ------------------------------------------------------------------------------
    def queued(self, run_key: str) -> set[int]:
        return {int(b) for b in self.r.smembers(key("queued", run_key))}

    def done(self, run_key: str) -> set[int]:
        return {int(b) for b in self.r.smembers(key("done", run_key))}

    def mark_queued(self, run_key: str, batch_ids: list[int]) -> None:
        if batch_ids:
            self.r.sadd(key("queued", run_key), *batch_ids)

    def mark_done(self, run_key: str, batch_ids: set[int]) -> None:
        """Batches the database has stored (a Redis that lost its data learns them again)."""
        if batch_ids:
            self.r.sadd(key("done", run_key), *batch_ids)

    def is_finished(self, run_key: str, batch_id: int) -> bool:
        return bool(self.r.sismember(key("done", run_key), batch_id))

    def start(self, run_key: str, batch_id: int, worker: str) -> int:
        """A worker starts a batch: returns the attempt number (1 for the first try)."""
        pipe = self.r.pipeline()
        pipe.hincrby(key("attempts", run_key), batch_id, 1)
        pipe.hset(key("running", run_key), batch_id, f"{worker} {time.time():.0f}")
        return int(pipe.execute()[0])

    def send_to_writer(self, kind: str, **fields) -> None:
        """A message on the ingest queue: open_run, ingest, failed or reopen."""
        self.r.rpush(INGEST, json.dumps({"kind": kind, **fields}))

    def analysed(self, run_key: str, batch_id: int, payload: str) -> None:
        """The result goes to the writer and the batch stops running, atomically."""
        pipe = self.r.pipeline()  # MULTI/EXEC
        pipe.rpush(INGEST, json.dumps({"kind": "ingest", "run_key": run_key, "batch_id": batch_id, "payload": payload}))
        pipe.hdel(key("running", run_key), batch_id)
        pipe.sadd(key("ingesting", run_key), batch_id)
        pipe.execute()

    def errored(self, run_key: str, batch_id: int, error: str) -> None:
        pipe = self.r.pipeline()
        pipe.hdel(key("running", run_key), batch_id)
        pipe.hset(key("errors", run_key), batch_id, error[:1000])
        pipe.execute()

    def last_error(self, run_key: str, batch_id: int) -> str | None:
        raw = self.r.hget(key("errors", run_key), batch_id)
        return raw.decode() if raw else None

    def finished(self, run_key: str, batch_id: int, *, failed: bool, windows: int = 0, pipe=None) -> None:
        """The writer has stored the batch (or its failure): it is no longer in flight.
        ``windows``: windows newly counted (0 for a redelivered batch)."""
        own = pipe is None
        pipe = self.r.pipeline() if own else pipe
        if windows:
            pipe.hincrby(key("run", run_key), "windows_done", windows)
        for what in ("queued", "ingesting"):
            pipe.srem(key(what, run_key), batch_id)
        pipe.hdel(key("running", run_key), batch_id)
        pipe.sadd(key("failed" if failed else "done", run_key), batch_id)
        if not failed:
            pipe.srem(key("failed", run_key), batch_id)
        if own:
            pipe.execute()

    def reset_failed(self, run_key: str, batch_ids: list[int]) -> None:
        """Before a retry: the failed batches get a fresh attempt count."""
        if not batch_ids:
            return
        pipe = self.r.pipeline()
        pipe.srem(key("failed", run_key), *batch_ids)
        pipe.srem(key("queued", run_key), *batch_ids)
        pipe.hdel(key("attempts", run_key), *batch_ids)
        pipe.hdel(key("errors", run_key), *batch_ids)
        pipe.execute()

    def windows_done(self, run_key: str) -> int:
        return int(self.r.hget(key("run", run_key), "windows_done") or 0)

    def backlog(self) -> int:
        """Messages waiting for the writer (all runs)."""
        return int(self.r.llen(INGEST)) + int(self.r.llen(PROCESSING))

    def live(self, run_key: str) -> Live:
        pipe = self.r.pipeline()
        pipe.scard(key("queued", run_key))
        pipe.hlen(key("running", run_key))
        pipe.scard(key("ingesting", run_key))
        pipe.scard(key("done", run_key))
        pipe.scard(key("failed", run_key))
        return Live(*(int(x) for x in pipe.execute()))

    # --- the writer's current work (for status, and for tests that stop it mid-ingest) --------
    def writer_state(self, state: str, **fields) -> None:
        self.r.hset(f"{PREFIX}:writer", mapping={"state": state, "since": f"{time.time():.3f}", **{k: str(v) for k, v in fields.items()}})
