"""Storage backends, chosen by the database URL (``--db``, ``HEADATLAS_DB``).

| ``--db`` | backend | module |
|---|---|---|
| a path (``atlas.duckdb``) | embedded DuckDB file, one writer at a time | ``file.py`` |
| ``ducklake:postgres:dbname=… host=…`` (+ ``--data-path``) | DuckLake, catalogue in PostgreSQL: many writers on many hosts | ``lake.py`` |
| ``ducklake:FILE.ducklake`` | DuckLake, catalogue in a local file (one host) | ``lake.py`` |

A backend is one module with one class (``base.Backend``) and one line in ``SCHEMES`` below.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from headatlas.service.storage.backends.base import Backend

# URL prefix -> the backend class's module and name; the first prefix that matches wins, and
# anything else is a path (the embedded file)
SCHEMES: list[tuple[str, str, str]] = [
    ("ducklake:", "headatlas.service.storage.backends.lake", "LakeBackend"),
]


def _cls(module: str, name: str) -> Callable[..., Backend]:
    import importlib

    return getattr(importlib.import_module(module), name)


def open_backend(db: str | Path | Backend, *, data_path: str | Path | None = None) -> Backend:
    """The backend for ``db`` (a Backend passes through). ``data_path``: where a lake's Parquet
    files go (default ``HEADATLAS_DATA_PATH``)."""
    if isinstance(db, Backend):
        return db
    text = str(db)
    for prefix, module, name in SCHEMES:
        if text.startswith(prefix):
            return _cls(module, name)(text, data_path=data_path)
    from headatlas.service.storage.backends.file import FileBackend

    return FileBackend(db)


def label(db: str | Path | Backend) -> str:
    """How ``db`` is shown in messages: a lake's password is never printed."""
    try:
        return open_backend(db).label
    except Exception:  # noqa: BLE001 - a URL too broken to parse still gets a safe label
        text = str(db)
        return text.split(":", 2)[0] + ":…" if text.startswith("ducklake:") else text
