"""Storage backends, chosen by the database URL (``--db``, ``HEADATLAS_DB``).

| ``--db`` | backend | module |
|---|---|---|
| a path (``atlas.duckdb``) | embedded DuckDB file, one writer at a time | ``file.py`` |
| ``ducklake:postgres:dbname=… host=…`` (+ ``--data-path``) | DuckLake, catalogue in PostgreSQL: many writers on many hosts | ``lake.py`` |
| ``ducklake:FILE.ducklake`` | DuckLake, catalogue in a local file (one host) | ``lake.py`` |

A backend is one module with one class (``base.Backend``) and one line in ``SCHEMES`` below, or a
class in a package installed beside headatlas, named under the ``headatlas.backends`` entry point
by its scheme (``memduck = "pkg.module:MemoryBackend"`` serves ``--db memduck:…``), read the
first time a ``--db`` value has a scheme that no built-in backend has.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from headatlas.service.storage.backends.base import Backend

# URL prefix -> the backend class's module and name; the first prefix that matches wins, and
# anything else is a path (the embedded file)
SCHEMES: list[tuple[str, str, str]] = [
    ("ducklake:", "headatlas.service.storage.backends.lake", "LakeBackend"),
]


def _cls(module: str, name: str) -> Callable[..., Backend]:
    import importlib

    return getattr(importlib.import_module(module), name)


SCHEME = re.compile(r"^([a-z][a-z0-9_+.-]*):")  # a URL's scheme, as a --db value starts with it


def _install_plugin(plugin: Any, value: Any) -> None:
    """A ``headatlas.backends`` entry point names a concrete Backend subclass; its name is the
    ``--db`` scheme it serves, which no built-in backend may have."""
    import inspect

    from headatlas.service.errors import PluginError

    if not (isinstance(value, type) and issubclass(value, Backend)) or inspect.isabstract(value):
        missing = ", ".join(sorted(getattr(value, "__abstractmethods__", ()))) if isinstance(value, type) else ""
        raise PluginError(f"{plugin.value} is not a Backend subclass" + (f" (it lacks {missing})" if missing else ""))
    if any(prefix == f"{plugin.name}:" for prefix, _module, _name in SCHEMES) or not SCHEME.match(f"{plugin.name}:"):
        raise PluginError(f"--db scheme {plugin.name!r} is headatlas's own or not a scheme")
    value.origin = plugin.origin


def plugin_backends() -> dict[str, Callable[..., Backend]]:
    """The backends of installed plugins by their ``--db`` scheme (read once per process)."""
    from headatlas.service import plugins

    return {plugin.name: value for plugin, value in plugins.load(plugins.BACKENDS, _install_plugin)}


def open_backend(db: str | Path | Backend, *, data_path: str | Path | None = None) -> Backend:
    """The backend for ``db`` (a Backend passes through). ``data_path``: where a lake's Parquet
    files go (default ``HEADATLAS_DATA_PATH``)."""
    if isinstance(db, Backend):
        return db
    text = str(db)
    for prefix, module, name in SCHEMES:
        if text.startswith(prefix):
            return _cls(module, name)(text, data_path=data_path)
    scheme = SCHEME.match(text) if isinstance(db, str) else None
    if scheme is not None and scheme.group(1) in plugin_backends():
        return plugin_backends()[scheme.group(1)](text, data_path=data_path)
    from headatlas.service.storage.backends.file import FileBackend

    return FileBackend(db)


def label(db: str | Path | Backend) -> str:
    """How ``db`` is shown in messages: a lake's password is never printed."""
    try:
        return open_backend(db).label
    except Exception:  # noqa: BLE001 - a URL too broken to parse still gets a safe label
        text = str(db)
        return text.split(":", 2)[0] + ":…" if text.startswith("ducklake:") else text
