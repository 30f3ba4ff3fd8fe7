"""A DuckDB file's lock, as another process meets it: recognising the conflict and waiting it
out. A leaf of the storage package (the file backend, the file checks and the sandbox use it),
importing nothing of headatlas but its errors and the recognition of DuckDB's errors
(duckdb_errors.py, another leaf)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from headatlas.service.errors import DatabaseLocked
from headatlas.service.storage.duckdb_errors import is_lock_conflict

T = TypeVar("T")

MAX_RETRY_DELAY_S = 0.2
__all__ = ["MAX_RETRY_DELAY_S", "is_lock_conflict", "retry_on_lock"]


def retry_on_lock(fn: Callable[[], T], *, wait_s: float, what: str = "the database") -> T:
    """Call ``fn`` until it stops failing on a DuckDB file lock, for at most ``wait_s`` seconds.

    DuckDB lets one process hold a file for writing and refuses every other process meanwhile,
    even read-only ones ("Could not set lock on file … Conflicting lock is held"). Waits back
    off exponentially (50 ms doubling, capped at 200 ms: a failed try costs a few milliseconds,
    and a longer cap made a waiting process miss the writer's gaps for seconds — a beat fire
    came 3 s late). Works on raw duckdb errors and on
    SQLAlchemy errors wrapping them, and on a backend's translation of them (``DatabaseLocked``).
    Other errors pass through at once.
    """
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        try:
            return fn()
        except Exception as error:
            if not (isinstance(error, DatabaseLocked) or is_lock_conflict(error)):
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise DatabaseLocked(
                    f"{what} is busy: another process is writing to it and held its lock for "
                    f"more than {wait_s:g} s; retry when that process finishes"
                ) from error
            time.sleep(min(delay, left))
            delay = min(delay * 2, MAX_RETRY_DELAY_S)
