"""Work for ``confined.run_confined`` in the tests: module-level, so that it pickles by reference for
a child that the clean helper starts (a closure does not), and light to import there."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# a lock that a thread of the calling process holds while the child starts: a child forked from
# that process would find it held for ever (the thread holding it does not exist there)
HELD = threading.Lock()
# what the calling process sets before the call: a child forked from it would see the new value
STATE = "imported"


def stuck(started: Callable[[], None]) -> None:
    started()
    time.sleep(60)  # nothing here checks for an interrupt


def greedy(started: Callable[[], None]) -> int:
    started()
    return len(bytearray(2 * 2**30))  # 2 GB against a 64 MB limit (plus the margins)


def inherited(started: Callable[[], None]) -> tuple[str, bool]:
    """(STATE as the child sees it, whether the child could take HELD within 2 s)."""
    started()
    took = HELD.acquire(timeout=2)
    return STATE, took
