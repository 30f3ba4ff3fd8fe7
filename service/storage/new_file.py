"""New database files made from a copy of one this process migrated, not by the migrations again.

Creating the schema of a new file runs every migration through alembic (about 0.4 s of CPU, most
of it DuckDB executing about 170 statements); a process that creates many databases (the Python
API in a notebook, a test suite, `headatlas db copy` in a loop) pays that each time. From its
second new file on, a process makes the schema once in a private file of its own, keeps its
bytes, and writes each further new file from them: a new ``database_id`` set in the copy before
it appears at its path (two databases never share an id, not even for an instant), and the file
linked into place only while the path is still free (another process that created the file first
wins, and this one goes on to check what it made). The bytes are those of a database the
migrations made at the current head revision, so a copy is the same schema, column for column
(tests/test_new_file.py); a database already there, a lake, or an upgrade never comes here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

from sqlalchemy import text

from headatlas.service.storage.backends import Backend
from headatlas.service.storage.backends.file import FileBackend

_LOCK = threading.Lock()
_MADE: dict[str, int] = {}  # head revision -> new files this process made by migrating
_BYTES: dict[str, bytes] = {}  # head revision -> a new database at that revision (this process's)


def create(backend: Backend, head: str, migrate) -> None:
    """Make the new database at ``backend`` (its file missing): from this process's copy of a
    database at ``head`` when it has one (made at its second new file), else by ``migrate(backend)``."""
    if not isinstance(backend, FileBackend):
        migrate(backend)
        return
    with _LOCK:
        template = _BYTES.get(head)
        if template is None:
            _MADE[head] = _MADE.get(head, 0) + 1
            if _MADE[head] >= 2:
                template = _template(head, migrate)
                if template is not None:
                    _BYTES[head] = template
    if template is None or not _place(backend.path, template):
        migrate(backend)  # the first new file, or the path taken meanwhile: the usual way checks it


def _template(head: str, migrate) -> bytes | None:
    """The bytes of a database the migrations made at ``head``, in a folder of this process's own;
    None where they would not be the database alone (a write-ahead log left beside it)."""
    folder = Path(tempfile.mkdtemp(prefix="headatlas-schema-"))
    try:
        path = folder / "schema.duckdb"
        migrate(FileBackend(path))
        if Path(f"{path}.wal").exists():  # not checkpointed: new files are made by the migrations
            return None
        return path.read_bytes()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _place(path: Path, template: bytes) -> bool:
    """Write ``template`` beside ``path`` with a database id of its own, then link it at ``path``
    if that is still free. False when another process made ``path`` first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a name DuckDB opens under an alias of its own (up to its first dot: file_instances), so the
    # copy is attached to an instance this process keeps rather than opened on a new instance
    # (a new file 31-33 -> 18-22 ms of CPU: benchmarks/transaction_cpu.py, "a new database file")
    fd, name = tempfile.mkstemp(prefix="headatlas_new_", suffix=f".{path.name}.new", dir=path.parent)
    staged = Path(name)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(template)
        backend = FileBackend(staged)
        engine = backend.engine()
        try:
            with engine.begin() as conn:
                conn.execute(text("UPDATE database_info SET value = CAST(uuid() AS VARCHAR) WHERE key = 'database_id'"))
        finally:
            engine.dispose()
        try:
            os.link(staged, path)  # fails where the path exists: never over a database
        except OSError:  # the path taken meanwhile, or a file system without hard links
            return False
        return True
    finally:
        for leftover in (staged, Path(f"{staged}.wal")):
            leftover.unlink(missing_ok=True)
