"""What a page reads: one read transaction per request, and results remembered per database state.

A page calls the library through ``Reads.get(key, compute)``. The result is kept in a small cache
(``Memo``, shared by the requests of one server) under ``key`` and the database's state:

- a DuckDB file: its size, modification time and inode, and its write-ahead log's (every commit
  changes one of them), read before the transaction begins;
- a lake: the snapshot the request's transaction sees (every commit is one);
- ``--at SNAPSHOT``: that snapshot, which never changes.

So a write to the database (a run stored, renamed, tagged or deleted, a batch of a running run) is
seen by the next request, and a page read twice runs its queries once.

What a finished run's pages read (its heads, layers, roles, anchors: seconds of SQL on a large run)
is kept by ``Reads.of_run`` under the run's own fingerprint instead (``run_results.fingerprint``: its
row but its name, and the rows it owns in every table: what its stored results are keyed by), so
that a write elsewhere (another run's batches, a rename, a tag) does not send the run's pages back
to their queries; a write to the run itself (effects or a probe added, a compaction) changes its
fingerprint. A value read from a state
newer than its key (a commit between the stat and the transaction) is replaced at the next request,
whose key differs; a value is never older than its key. The transaction is opened at the first
value not remembered, so a page whose values are all remembered opens nothing.

The cache is bounded in bytes as well as in entries (``MEMO_BYTES``, an estimate: ``approx_bytes``): a
value over a quarter of it is not kept (a large SQL result is computed again when asked again), so a
few large answers cannot hold the server's memory.

The schema check every read transaction makes (``db.check_schema``) is made once per state the
transaction reads: a file's state is read again once it is open (no process writes it while a
reader holds it), so a file changed in any way is checked again.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from contextlib import ExitStack
from typing import Any, TypeVar

from sqlalchemy.engine import Connection

from headatlas.service.statuses import RunStatus
from headatlas.service.storage import db
from headatlas.service.storage.run_results import read_fingerprint, read_fingerprints
from headatlas.service.storage.store import Run, Store

T = TypeVar("T")

MEMO_BYTES = 64 * 2**20  # what a server's page cache holds at most (estimated: approx_bytes)


class Memo:
    """A bounded cache, least recently used out first: at most ``size`` values and ``max_bytes``
    bytes (estimated by ``approx_bytes``; None: unbounded in bytes), a value over ``max_bytes / 4``
    never kept. Safe to share between threads (two threads asking for the same missing value may each
    compute it once)."""

    def __init__(self, size: int = 512, *, max_bytes: int | None = MEMO_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0  # the estimated size of what is kept

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key][0]
        value = compute()  # outside the lock: a slow query holds up no other request
        size = 0 if self.max_bytes is None else approx_bytes(value) + approx_bytes(key)
        if self.max_bytes is not None and size > self.max_bytes // 4:
            return value  # too large to keep: computed again when asked again
        with self._lock:
            if key in self._items:  # another thread kept it meanwhile
                self.bytes -= self._items[key][1]
            self._items[key] = (value, size)
            self._items.move_to_end(key)
            self.bytes += size
            while len(self._items) > self.size or (self.max_bytes is not None and self.bytes > self.max_bytes):
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped
        return value

    def __len__(self) -> int:
        return len(self._items)


_SAMPLE = 32  # elements of a container measured; the rest are taken to be of their mean size
_VISITS = 2048  # objects one estimate looks at, at most (nested containers: the sample shrinks)


def approx_bytes(value: object) -> int:
    """About how many bytes ``value`` holds, itself and what it refers to, in time that does not
    grow with its size: a container's size is its first, last and evenly spaced elements' mean size
    times its length (``_SAMPLE`` of them at most, ``_VISITS`` objects in all); an array's, its
    buffer's. For a bound on memory, not an exact figure (shared objects count at each reference)."""
    return _approx(value, [_VISITS])


def _approx(value: object, budget: list[int]) -> int:
    size = sys.getsizeof(value, 64)
    budget[0] -= 1
    kind = type(value)
    if kind in (str, bytes, bytearray, int, float, bool, type(None), complex) or budget[0] <= 0:
        return size
    nbytes = getattr(value, "nbytes", None)  # a NumPy array: its buffer
    if isinstance(nbytes, int):
        return max(size, nbytes)
    if isinstance(value, dict):
        return size + _sampled(list(value.items()), budget)
    if isinstance(value, (list, tuple)):
        return size + _sampled(value, budget)
    if isinstance(value, (set, frozenset)):
        return size + _sampled(list(value), budget)
    usage = getattr(value, "memory_usage", None)  # a pandas frame or series
    if callable(usage):
        try:
            measured = usage(index=True, deep=False)
            return size + int(measured.sum() if hasattr(measured, "sum") else measured)
        except (TypeError, ValueError):
            pass
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        return size + _approx(fields, budget)
    names = {name for cls in kind.__mro__ for name in getattr(cls, "__slots__", ()) if isinstance(name, str)}
    return size + sum(_approx(getattr(value, name), budget) for name in names if hasattr(value, name))


def _sampled(items: Any, budget: list[int]) -> int:
    n = len(items)
    if not n:
        return 0
    k = max(1, min(n, _SAMPLE, budget[0]))
    picked = items if k == n else [items[i * (n - 1) // max(1, k - 1)] for i in range(k)]
    return sum(_approx(item, budget) for item in picked) * n // len(picked)


class Reads:
    """One request's reads of ``store``: ``get`` remembers, ``conn`` is the request's one read
    transaction (opened when first needed, closed with the request)."""

    def __init__(self, store: Store, memo: Memo) -> None:
        self.store, self.memo = store, memo
        self._stack = ExitStack()
        self._conn: Connection | None = None
        self._state: Hashable | None = None
        self._read: Hashable | None = None  # the state the open transaction reads

    def __enter__(self) -> Reads:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def close(self) -> None:
        """Close the request's transaction now (a later read opens another)."""
        self._stack.close()
        self._stack, self._conn = ExitStack(), None

    @property
    def conn(self) -> Connection:
        """The request's read transaction, on a database whose schema is current (``checked_read``)."""
        if self._conn is None:
            conn = self._stack.enter_context(self.store.read())
            self._read = self._read_state(conn)

            def check() -> None:
                db.check_schema(conn, self.store.backend, at=self.store.at)

            if self._read is None:
                check()
            else:  # once per state read (a check that fails raises: it is not remembered)
                self.memo.get((self.store.backend.label, self._read, "schema checked"), check)
            self._conn = conn
        return self._conn

    def state(self) -> Hashable:
        """The database's state, as this request found it (see the module's docstring)."""
        if self._state is None:
            if self.store.at is not None:
                self._state = ("at", self.store.at)
            elif getattr(self.store.backend, "snapshots", False):
                _ = self.conn  # the snapshot the request's transaction reads, found when it opens
                self._state = self._read
            else:
                self._state = _file_state(self.store) or ("opened", id(self.conn))
        return self._state

    def _read_state(self, conn: Connection) -> Hashable | None:
        """The state that transaction ``conn`` reads (None: unknown)."""
        if self.store.at is not None:
            return ("at", self.store.at)
        if getattr(self.store.backend, "snapshots", False):
            return ("snapshot", self.store.snapshot(conn))
        return _file_state(self.store)  # no process writes the file while this transaction is open

    def get(self, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()`` (which reads ``self.conn`` or the store), remembered under ``key`` for the
        database's present state."""
        return self.memo.get((self.store.backend.label, self.state(), *key), compute)

    def of_run(self, run: Run, key: tuple, compute: Callable[[], T]) -> T:
        """``compute()`` (which reads run ``run`` alone), remembered under ``key`` for the run's
        fingerprint when the run is finished (what it stored no longer changes but by an explicit
        write to it), for the database's state otherwise."""
        if run.status != RunStatus.DONE:
            return self.get(("run", run.run_id, *key), compute)
        fingerprint = self._fingerprint(run.run_id)
        return self.memo.get((self.store.backend.label, "run", run.run_id, fingerprint, *key), compute)

    def _fingerprint(self, run_id: int) -> str | None:
        return self.get(("fingerprint", run_id), lambda: read_fingerprint(self.conn, run_id))

    def of_runs(self, runs: tuple[Run, ...], key: tuple, compute: Callable[[], T]) -> T:
        """``of_run`` for ``compute()`` that reads these runs alone (two runs compared)."""
        ids = tuple(r.run_id for r in runs)
        if any(r.status != RunStatus.DONE for r in runs):
            return self.get(("runs", ids, *key), compute)
        prints = self.get(("fingerprints", ids), lambda: tuple(read_fingerprints(self.conn, ids)))
        return self.memo.get((self.store.backend.label, "runs", ids, prints, *key), compute)


def _file_state(store: Store) -> Hashable | None:
    """A file's state: its size, modification time and inode, and its write-ahead log's; None where
    the store is no file or the file cannot be read (the transaction says why, in the store's words)."""
    path = getattr(store.backend, "path", None)
    if path is None:
        return None
    try:
        stats = [os.stat(path)]
    except OSError:
        return None
    try:
        stats.append(os.stat(f"{path}.wal"))
    except OSError:
        pass
    return ("file", *((s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns) for s in stats))
