"""Checks on a database file before DuckDB opens it, and DuckDB's failures as one-line errors.

DuckDB opens some damaged files without complaint: a file cut short keeps a valid header, opens,
and a writer then appends to it. So before a file is opened we read its first 12 KiB: the magic
``DUCK`` at offset 8 says it is a DuckDB file, and the newer of the two database headers gives
the block size: the file is 12 KiB of headers and then whole blocks, so a copy cut mid-block
shows. (The header's block count is no bound: DuckDB cuts free blocks off the end without
lowering it. A cut that falls exactly on a block boundary passes here; DuckDB then fails on the
first read of a missing block, which ``translate`` turns into a one-line error too.)

A file this process has open through DuckDB is not read again here: DuckDB locks its file with
POSIX record locks (fcntl), and the kernel drops every such lock a process holds on a file when the
process closes any descriptor of that file. Reading the header beside an open connection (a
transaction begun while the run held its file, a second thread of the beat) let another process
open the same file for writing at the same time. ``PROCESS_LOCK`` serialises this process's opens
and these reads; ``OPEN`` counts the connections open on each file.

``translate`` is the file backend's one translation of DuckDB's errors into headatlas's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import struct
import threading
import time
from collections import Counter
from pathlib import Path

import duckdb
from sqlalchemy.exc import DBAPIError

from headatlas.service.errors import ANALYZE, DatabaseFileError, DatabaseLocked, DatabaseNotFound, HeadatlasError, Param
from headatlas.service.storage import duckdb_errors

# DuckDB refuses a read-only and a read-write connection to one file in one process at once:
# threads of one process (beat's tick and the fires it runs) open the file in turn, and read a
# header only while no connection of this process is open on it (above).
PROCESS_LOCK = threading.RLock()
OPEN: Counter[tuple[int, int] | None] = Counter()  # a file (device, inode) -> this process's DuckDB connections on it


def file_key(path: str | Path) -> tuple[int, int] | None:
    """The file at ``path`` as the kernel's locks know it (device, inode); None where there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def opened(path: str | Path) -> tuple[int, int] | None:
    """Count a DuckDB connection this process has just opened on ``path`` (under ``PROCESS_LOCK``);
    the key to hand to ``closed`` once it is closed."""
    key = file_key(path)
    OPEN[key] += 1
    return key


def closed(key: tuple[int, int] | None) -> None:
    """The connection counted by ``opened`` (its key) is closed."""
    OPEN[key] -= 1
    if OPEN[key] <= 0:
        del OPEN[key]


def _forget_open() -> None:
    # a child forked while another thread held the lock has only the forking thread: the lock would
    # never be released there; and the parent's connections are not the child's
    PROCESS_LOCK._at_fork_reinit()  # type: ignore[attr-defined]
    OPEN.clear()


os.register_at_fork(after_in_child=_forget_open)

MAGIC = b"DUCK"
MAGIC_OFFSET = 8
HEADER_BYTES = 4096  # the file header, then two database headers of this size each
_DB_HEADERS = (HEADER_BYTES, 2 * HEADER_BYTES)
_FIRST_BLOCK = 3 * HEADER_BYTES
_REPLACE = ("pass another ", Param("db"), " (a new file is created), or restore this one from a copy")


def check_file(path: str | Path, *, write: bool, create: bool = True, serialised: bool = True) -> None:
    """Raise DatabaseFileError when ``path`` cannot be a usable database: a folder, not a regular
    file (a named pipe would block DuckDB forever), not a DuckDB file, cut short, or (``write``) a
    file or folder this process may not write. A missing file passes when ``write`` and
    ``create`` (it will be created) and fails otherwise. ``serialised``: the header is read under
    ``PROCESS_LOCK`` and not while the file is open here (the file backend's opens take that lock;
    a lake's catalogue file is attached under locks of its own, and read as before)."""
    path = Path(path)
    if _loops(path):  # Path.exists() says False: it would be "no database" or a failed create
        raise DatabaseFileError(
            Param("db", path), " is a symbolic link loop (the link leads back to itself): point it at a database file"
        )
    if path.is_dir():
        raise DatabaseFileError(
            Param("db", path), f" is a folder: pass a database file such as {path / 'headatlas.duckdb'}"
        )
    if path.exists() and not path.is_file():
        raise DatabaseFileError(
            Param("db", path), " is not a regular file (a pipe, socket or device): pass a database file"
        )
    if not path.exists():
        if not (write and create):
            raise DatabaseNotFound(
                f"no database at {path}: ", ANALYZE, " first, or set HEADATLAS_DB / pass ", Param("db")
            )
        folder = path.parent if str(path.parent) else Path(".")
        if folder.exists() and not os.access(folder, os.W_OK | os.X_OK):
            raise DatabaseFileError(
                f"cannot create {path}: folder {folder} is read-only",
                hint=("pass ", Param("db"), " in a writable folder"),
            )
        return
    if not os.access(path, os.R_OK):
        raise DatabaseFileError(
            f"cannot read {path}: permission denied", hint=("fix its permissions or pass another ", Param("db"))
        )
    with PROCESS_LOCK if serialised else contextlib.nullcontext():
        if serialised and OPEN[file_key(path)]:  # open here: checked when it was opened, not to be read now
            head = None
        else:
            with path.open("rb") as stream:
                head = stream.read(_FIRST_BLOCK)
    if head is not None:
        _check_head(path, head)
    if write:
        if not os.access(path, os.W_OK):
            raise DatabaseFileError(f"{path} is read-only: make it writable (chmod u+w) or pass another ", Param("db"))
        folder = path.parent if str(path.parent) else Path(".")
        if not os.access(folder, os.W_OK | os.X_OK):  # DuckDB writes its .wal next to the file
            raise DatabaseFileError(
                f"{path} lies in read-only folder {folder}: DuckDB needs to write {path.name}.wal there; "
                "make the folder writable or copy the database elsewhere"
            )


def _check_head(path: Path, head: bytes) -> None:
    size = path.stat().st_size  # for messages; the alignment check re-reads it
    if head[MAGIC_OFFSET : MAGIC_OFFSET + len(MAGIC)] != MAGIC:
        what = "an empty file" if size == 0 else f"{size:,} bytes"
        raise DatabaseFileError(f"{path} is not a DuckDB database ({what}, no DuckDB header)", hint=_REPLACE)
    block = block_size(head) if len(head) == _FIRST_BLOCK else None
    if len(head) < _FIRST_BLOCK or (block is not None and not _settles_aligned(path, block)):
        # DuckDB writes whole blocks after 12 KiB of headers; a copy cut short ends mid-block
        whole = f"{_FIRST_BLOCK:,} bytes of headers" + (f" and whole blocks of {block:,}" if block else "")
        raise DatabaseFileError(f"{path} is cut short: {size:,} bytes, not {whole}", hint=_REPLACE)


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    return False


def _settles_aligned(path: Path, block: int, *, wait_s: float = 1.0) -> bool:
    """Whether the file is headers plus whole blocks, or becomes so within ``wait_s``: another
    process extending the file (a checkpoint) is seen mid-write for a moment; a cut file stays cut."""
    deadline = time.monotonic() + wait_s
    while True:
        if (path.stat().st_size - _FIRST_BLOCK) % block == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def block_size(head: bytes) -> int | None:
    """Block size in bytes of the file whose first 12 KiB are ``head``, from the newer of its two
    database headers; None when the headers are unreadable (another DuckDB storage version's
    layout): DuckDB's own checks then apply."""
    best = None
    for offset in _DB_HEADERS:
        # checksum, iteration, meta block, free list, block count, block allocation size
        _checksum, iteration, _meta, _free, _blocks, size = struct.unpack_from("<6Q", head, offset)
        plausible = 4096 <= size <= 1 << 26 and size & (size - 1) == 0
        if plausible and (best is None or iteration > best[0]):
            best = (iteration, size)
    return None if best is None else best[1]


def translate(path: str | Path, exc: BaseException) -> HeadatlasError | None:
    """DuckDB's error ``exc`` about the file ``path`` as headatlas's: another process holding the
    file is ``DatabaseLocked`` (nothing was written: retry); a failure to open or read it is a
    one-line ``DatabaseFileError``; None for errors that are not about the file (a query's
    mistake), which pass as they are."""
    if duckdb_errors.is_lock_conflict(exc):
        return DatabaseLocked(
            f"{path} is busy: another process held a lock on it while this transaction committed; nothing was "
            "written, retry"
        )
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if orig is None:  # a DBAPIError without the driver's error
        return None
    # IOException: unreadable, not a database, cut short; the bare duckdb.Error: a checksum
    # mismatch ("Corrupt database file"); FatalException: the database was invalidated.
    if isinstance(orig, (duckdb.IOException, duckdb.FatalException)) or type(orig) is duckdb.Error:
        if "newer version of DuckDB" in str(orig):
            return _newer_duckdb(path, str(orig))
        lines = [line.strip() for line in str(orig).splitlines() if line.strip()]
        detail = lines[0] if lines else type(orig).__name__
        return DatabaseFileError(f"cannot use database {path} ({detail[:300]})", hint=_REPLACE)
    return None


_GIT_DESC = slice(52, 84)  # the main header's library_git_desc: the DuckDB release that wrote the file


def _newer_duckdb(path: str | Path, message: str) -> DatabaseFileError:
    """A file in a storage format this DuckDB cannot read: not damaged, and no copy of it would do."""
    try:
        with open(path, "rb") as stream:
            desc = stream.read(_GIT_DESC.stop)[_GIT_DESC].split(b"\0", 1)[0].decode("ascii", "replace")
    except OSError:
        desc = ""
    writer = f"DuckDB {desc}" if desc.startswith("v") else "a newer DuckDB"
    versions = re.search(r"version number (\d+), but we can only read versions between (\d+) and (\d+)", message)
    storage = (
        f"storage version {versions[1]}; this headatlas's DuckDB {duckdb.__version__} reads {versions[2]} to "
        f"{versions[3]}"
        if versions
        else f"this headatlas's DuckDB is {duckdb.__version__}"
    )
    return DatabaseFileError(
        f"{path} was written by {writer} ({storage}): upgrade headatlas and duckdb "
        "(`pip install -U headatlas duckdb`), or pass another ",
        Param("db"),
        "; the file is kept as it is",
    )
