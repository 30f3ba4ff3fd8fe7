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

The schema check every read transaction makes (``db.check_schema``) is made once per state the
transaction reads: a file's state is read again once it is open (no process writes it while a
reader holds it), so a file changed in any way is checked again.
"""

from __future__ import annotations

import os
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


class Memo:
    """A bounded cache, least recently used out first; safe to share between threads (two threads
    asking for the same missing value may each compute it once)."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()  # outside the lock: a slow query holds up no other request
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


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
