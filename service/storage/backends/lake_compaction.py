"""Compacting a lake (``db compact``): merging small Parquet files, expiring old snapshots,
deleting the files no snapshot needs any more and the data files its catalogue never knew, one
compaction at a time (a claim in ``database_info``).

DuckLake's own functions do the work, one at a time (each is its own commit), each tried again
when a writer's commit changed the same files.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import duckdb
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.config import SQL_TIMEOUT_MAX_S
from headatlas.service.errors import DatabaseFileError, StoreConflict
from headatlas.service.storage.backends.base import Backend
from headatlas.service.storage.backends.lake_catalogue import ALIAS, METADATA

# a file no snapshot needs any more is deleted this long after (by a later compaction): longer than
# any writer's transaction (a group of batches, seconds) or reader's query that may still read it
# from a snapshot it began at: `sql` runs at most SQL_TIMEOUT_MAX_S (a day), after a start of at most
# its lock wait and readonly.SETUP_S; an hour more covers those
FILES_GRACE_S = SQL_TIMEOUT_MAX_S + 3600.0
COMPACTION = "compaction"  # database_info key: the compaction in progress (host, pid, since)
COMPACTION_STALE_S = 24 * 3600.0  # another host's claim older than this is left behind
# an uncatalogued data file younger than this may still be committed by a transaction in flight
# (another writer's, `db compact`'s merge): `db compact` removes only older ones
ORPHAN_AGE_S = 3600.0


def maintain(
    backend: Backend, *, older_than_days: float, files_grace_s: float, redact: Callable[[str], str]
) -> dict[str, Any]:
    """Merge small Parquet files, expire snapshots older than ``older_than_days`` (0: all but
    the current one) and delete the files no snapshot needs any more: DuckLake's own
    functions, one at a time (each is its own commit). One compaction at a time: a second is
    refused while the first runs (``claim``). A file is deleted only once no snapshot has
    needed it for ``files_grace_s``: a writer's or reader's transaction that began before the
    expiry still reads it (the next compaction deletes it). ``redact``: a message as it may be
    shown (no password)."""
    cutoff = f"now() - INTERVAL {float(older_than_days) * 86400:.0f} SECOND"
    files_cutoff = f"now() - INTERVAL {max(0.0, float(files_grace_s)):.0f} SECOND"
    token = claim(backend)
    try:
        root = backend.connect()
        try:
            before = _lake_counts(root)
            started = time.monotonic()
            _maintenance(backend, root, f"CALL ducklake_merge_adjacent_files('{ALIAS}')", redact)
            _maintenance(backend, root, f"CALL ducklake_expire_snapshots('{ALIAS}', older_than => {cutoff})", redact)
            _maintenance(
                backend, root, f"CALL ducklake_cleanup_old_files('{ALIAS}', older_than => {files_cutoff})", redact
            )
            orphans = _remove_orphans(root, ORPHAN_AGE_S)
            after = _lake_counts(root)
            return {
                "files_before": before[0],
                "files_after": after[0],
                "snapshots_before": before[1],
                "snapshots_after": after[1],
                "orphans_removed": orphans,
                "seconds": round(time.monotonic() - started, 2),
            }
        finally:
            root.close()
    finally:
        release_claim(backend, token)


def _maintenance(
    backend: Backend, root: duckdb.DuckDBPyConnection, call: str, redact: Callable[[str], str], tries: int = 20
) -> None:
    """One maintenance call, tried again when a writer's commit changed the same files."""
    delay = 0.05
    for attempt in range(tries):
        try:
            root.execute(call)
            return
        except duckdb.Error as exc:
            translated = backend.translate(exc)
            if not isinstance(translated, StoreConflict):
                raise translated or DatabaseFileError(
                    f"db compact of {backend.label}: {redact(str(exc)).strip().splitlines()[0][:300]}"
                ) from None
            if attempt == tries - 1:
                raise StoreConflict(
                    f"db compact of {backend.label}: writers kept changing the files it merges; run it again"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def claim(backend: Backend) -> str:
    """Hold the lake's compaction (a row in database_info, claimed under ``db.serialize``:
    two claims at once conflict, and the second, tried again, finds the first). A second
    `db compact` while one runs is refused in one line; a claim whose process is gone (this
    host) or older than COMPACTION_STALE_S (another host) is taken over. The claim's token,
    for ``release_claim``."""
    import socket
    import uuid

    from headatlas.service.errors import StoreBusy
    from headatlas.service.storage import db

    token = uuid.uuid4().hex
    mine = {"token": token, "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}

    def hold(conn: Connection) -> None:
        db.serialize(conn)
        raw = conn.execute(text("SELECT value FROM database_info WHERE key = :k"), {"k": COMPACTION}).scalar()
        held = json.loads(raw) if raw else None
        if held is not None and not _claim_gone(held):
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held["since"]))
            raise StoreBusy(
                f"another `db compact` of {backend.label} is running ({held['host']}:{held['pid']}, since {started}): "
                "wait for it to end, then run it again if needed"
            )
        conn.execute(text("DELETE FROM database_info WHERE key = :k"), {"k": COMPACTION})
        conn.execute(text("INSERT INTO database_info VALUES (:k, :v)"), {"k": COMPACTION, "v": json.dumps(mine)})

    db.atomically(backend, hold)
    return token


def release_claim(backend: Backend, token: str) -> None:
    """Give up the compaction ``claim`` took (only while it still holds it)."""
    from headatlas.service.storage import db

    def release(conn: Connection) -> None:
        raw = conn.execute(text("SELECT value FROM database_info WHERE key = :k"), {"k": COMPACTION}).scalar()
        if raw and json.loads(raw).get("token") == token:
            conn.execute(text("DELETE FROM database_info WHERE key = :k"), {"k": COMPACTION})

    db.atomically(backend, release)


def _claim_gone(held: dict) -> bool:
    """Whether a compaction claim is left behind: its process is gone (this host), or it is older
    than COMPACTION_STALE_S (another host's, which cannot be asked)."""
    import socket

    if held.get("host") == socket.gethostname():
        try:
            os.kill(int(held["pid"]), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return time.time() - float(held.get("since", 0)) > COMPACTION_STALE_S


def orphan_files(backend: Backend) -> list[str]:
    """The lake's data files that its catalogue does not know (a write that failed after
    its file was created), by DuckLake's own listing; only its ``ducklake-*.parquet``."""
    with backend.session() as conn:
        rows = conn.execute(
            text(f"SELECT path FROM ducklake_delete_orphaned_files('{ALIAS}', dry_run => true, cleanup_all => true)")
        ).all()
    return sorted(p for (p,) in rows if _is_data_file(p))


def _is_data_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("ducklake-") and name.endswith(".parquet")


def _remove_orphans(connection: duckdb.DuckDBPyConnection, older_than_s: float) -> int:
    """Delete the lake's data files its catalogue does not know, last changed over
    ``older_than_s`` ago (a younger one may belong to a transaction still in flight elsewhere);
    only DuckLake's own files (``ducklake-*.parquet``). How many."""
    rows = connection.execute(
        f"SELECT path FROM ducklake_delete_orphaned_files('{ALIAS}', dry_run => true, "
        f"older_than => now() - INTERVAL {max(0.0, float(older_than_s)):.0f} SECOND)"
    ).fetchall()
    removed = 0
    for (path,) in rows:
        if _is_data_file(path) and "://" not in path:
            try:
                os.remove(path)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _lake_counts(connection: duckdb.DuckDBPyConnection) -> tuple[int, int]:
    """(live Parquet data files, snapshots) of the lake."""
    files = connection.execute(
        f"SELECT count(*) FROM {METADATA}.ducklake_data_file WHERE end_snapshot IS NULL"
    ).fetchone()
    snaps = connection.execute(f"SELECT count(*) FROM ducklake_snapshots('{ALIAS}')").fetchone()
    return int(files[0]) if files else 0, int(snaps[0]) if snaps else 0
