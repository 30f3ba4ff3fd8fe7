"""What the writer does while it cannot store: its lake unavailable (the catalogue's connection
lost, the data path full or read-only), its database file away (moved, deleted, replaced), or the
database the last writer of this broker stored into missing at start.

It pauses, says what it waits for (in its log, once per cause, and to `headatlas status`), tries
again with backoff (workers/policy.py: PAUSE_FIRST_S doubling to PAUSE_MAX_S, AWAY_POLL_S for a
file away), and goes on when the fault clears; the messages in hand go back to the queue, and a
batch stored twice counts once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis

from headatlas.service.errors import HeadatlasError, StoreUnavailable
from headatlas.service.storage.backends import Backend
from headatlas.service.storage.store import Store
from headatlas.service.wording import seconds
from headatlas.workers.lease import WriterLease
from headatlas.workers.ledger import INGEST, ORPHANS, Ledger, processing_lists
from headatlas.workers.messages import Undecodable, decode
from headatlas.workers.policy import AWAY_POLL_S, FLAP_S, PAUSE_FIRST_S, PAUSE_MAX_S, next_pause
from headatlas.workers.writer_store import file_database_id

log = logging.getLogger("headatlas.writer")


@dataclass
class Pause:
    """The writer waits for its lake (``StoreUnavailable.waits_for``) since ``since``."""

    waits_for: str
    cause: str
    since: float  # time.monotonic()
    wall: float  # time.time(), for status
    delay: float = PAUSE_FIRST_S
    tries: int = 0
    data_path: bool = False  # a write failed on the data path during the pause: look for orphans


class Pauses:
    """The writer's pauses (a part of ``Writer``)."""

    backend: Backend
    db_label: str
    lease: WriterLease
    ledger: Ledger
    store: Store
    database_id: str
    _pause: Pause | None
    _resumed_at: tuple[float, float, tuple[str, str] | None]
    _away: str | None

    def _wait_for_last_database(self) -> None:
        """The last writer on this broker stored into this path, and messages or runs of its
        database are still in flight, but the file is missing or another database: wait for it
        instead of creating a new database (which would drop every analysed batch)."""
        last = self.lease.last()
        if not last or last.get("db") != self.lease.db or not last.get("database_id"):
            return
        wanted, said = last["database_id"], False
        while True:
            found = file_database_id(self.backend)
            waiting = _messages_for(self.lease.r, wanted)
            runs = Ledger(self.lease.r, wanted).active_runs()
            if found == wanted or not (waiting or runs):
                if said:
                    log.warning("database %s is back; storing", self.db_label)
                return
            if not said:
                what = (
                    "missing"
                    if not self.backend.exists()
                    else f"database {found[:8]}"
                    if found
                    else "not that database"
                )
                log.error(
                    "the last writer on this broker stored into %s (database %s), which %d message(s) and %d run(s) in "
                    "flight are for, but that file is now %s: waiting for it to come back instead of creating a new "
                    "database (nothing is dropped). To give those runs up and start afresh here, delete the Redis key "
                    "headatlas:writer:last",
                    self.db_label,
                    wanted[:8],
                    waiting,
                    len(runs),
                    what,
                )
                said = True
            self.lease.refresh()
            time.sleep(AWAY_POLL_S)

    def _unavailable(self, exc: StoreUnavailable) -> None:
        """Pause: say so (once per cause) in the log and to `status`, wait, double the wait."""
        pause = self._pause
        if pause is None or (pause.waits_for, pause.cause) != (exc.waits_for, exc.cause):
            if pause is None:
                pause = self._pause = Pause(exc.waits_for, exc.cause, time.monotonic(), time.time())
                ended, delay, cause = self._resumed_at
                again = time.monotonic() - ended < FLAP_S  # the probe passed, the work did not (a data
                if again:  # path with little room): go on backing off, and say it once
                    pause.delay = delay
                verb = "" if again and cause == (exc.waits_for, exc.cause) else "paused"
            else:
                pause.waits_for, pause.cause = exc.waits_for, exc.cause
                verb = f"still paused ({time.monotonic() - pause.since:.1f} s)"
            log.log(
                logging.ERROR if verb else logging.DEBUG,
                "%s: %s; %s message(s) wait in Redis (none is lost); waiting for %s, trying again every %.1f s "
                "doubling to %.0f s",
                verb or "paused again",
                exc,
                self._backlog(),
                exc.waits_for,
                PAUSE_FIRST_S,
                PAUSE_MAX_S,
            )
        from headatlas.service.storage.backends.lake_errors import DATA_PATH

        pause.data_path = pause.data_path or exc.waits_for == DATA_PATH
        pause.tries += 1
        try:
            self.lease.say_paused(pause.waits_for, pause.cause, pause.wall, pause.delay, pause.tries)
        except redis.RedisError:
            pass  # the broker is away too: the loop finds out
        time.sleep(pause.delay)
        pause.delay = next_pause(pause.delay)

    def _probe(self) -> None:
        """Raise StoreUnavailable while what the writer waits for (its lake's catalogue, when it
        is not paused) is still unavailable."""
        from headatlas.service.storage.backends.lake import LakeBackend
        from headatlas.service.storage.backends.lake_errors import CATALOGUE

        if isinstance(self.backend, LakeBackend):
            self.backend.probe(self._pause.waits_for if self._pause is not None else CATALOGUE)

    def _resumed(self) -> None:
        """The fault cleared (the probe passed): say after how long, and the data files the failed
        writes left; the messages go back on the queue and are stored now."""
        pause, self._pause = self._pause, None
        assert pause is not None
        self._resumed_at = (time.monotonic(), pause.delay, (pause.waits_for, pause.cause))
        took = time.monotonic() - pause.since
        orphans = ""
        if pause.data_path:
            orphans = self._count_orphans()
        log.warning(
            "%s is back after %.1f s (%d failed attempt(s)); storing again%s",
            pause.waits_for,
            took,
            pause.tries,
            orphans,
        )
        try:
            self.lease.clear_paused()
        except redis.RedisError:
            pass

    def _count_orphans(self) -> str:
        """The lake's uncatalogued data files (writes that failed after creating their file), for
        the log and `status`; `db compact` removes them once they are an hour old (a younger one
        may still be committed by a transaction in flight elsewhere)."""
        from headatlas.service.storage.backends.lake import LakeBackend
        from headatlas.service.storage.backends.lake_compaction import ORPHAN_AGE_S

        if not isinstance(self.backend, LakeBackend):
            return ""
        try:
            found = len(self.backend.orphan_files())
        except HeadatlasError as exc:
            return f"; could not count the uncatalogued data files ({exc})"
        try:
            ledger = getattr(self, "ledger", None) or Ledger(self.lease.r, self.database_id)
            ledger.r.hset(ledger.key(ORPHANS, "lake"), mapping={"files": found, "at": f"{time.time():.3f}"})
        except redis.RedisError:
            pass
        if not found:
            return "; the failed writes left no data file"
        return (
            f"; {found} uncatalogued data file(s) in the data path, left by the writes that failed: "
            f"`headatlas db compact` removes them once {ORPHAN_AGE_S / 3600:.0f} h old"
        )

    def _backlog(self) -> int | str:
        try:
            r = self.lease.r
            return int(r.llen(INGEST)) + sum(int(r.llen(name)) for name in processing_lists(r))
        except redis.RedisError:
            return "?"

    def _database_away(self, why: str) -> None:
        if why != self._away:
            try:
                waiting = self.ledger.backlog()
            except redis.RedisError:
                waiting = -1
            log.error(
                "%s (%s message(s) waiting); the writer pauses and looks again every %s s",
                why,
                "?" if waiting < 0 else waiting,
                seconds(AWAY_POLL_S),
            )
            self._away = why


def _messages_for(client: redis.Redis, database_id: str) -> int:
    """Messages on the ingest queue (waiting or taken) for the database ``database_id``."""
    count = 0
    for raw in [
        *client.lrange(INGEST, 0, -1),
        *(m for name in processing_lists(client) for m in client.lrange(name, 0, -1)),
    ]:
        try:
            count += decode(raw).database_id == database_id
        except Undecodable:
            continue
    return count
