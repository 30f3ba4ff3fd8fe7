"""Lakes for the tests: DuckLake catalogues in this machine's PostgreSQL, data in a temporary folder.

Every test gets a catalogue database of its own (``ha_test_<random>``), created and dropped. A
new lake is migrated once per session into a template (``ha_test_<random>_tpl`` and its data
folder); each test's lake is a copy of it (``CREATE DATABASE … TEMPLATE``, and the data folder
copied), so a test does not pay the migrations. The server is found at
``HEADATLAS_TEST_PG`` (libpq key=value, default ``host=127.0.0.1 user=postgres``); the lake tests
skip, saying why, when no PostgreSQL answers there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

PG = os.environ.get("HEADATLAS_TEST_PG", "host=127.0.0.1 user=postgres")


def _psql(sql: str, dbname: str = "postgres") -> subprocess.CompletedProcess:
    return subprocess.run(
        ["psql", f"{PG} dbname={dbname} connect_timeout=5", "-v", "ON_ERROR_STOP=1", "-qtAc", sql],
        capture_output=True,
        text=True,
        timeout=60,
    )


def unavailable() -> str | None:
    """Why lakes cannot be tested here, or None."""
    if shutil.which("psql") is None:
        return "no psql on PATH (PostgreSQL client): the lake tests need a PostgreSQL server"
    try:
        result = _psql("SELECT 1")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"PostgreSQL at {PG!r} did not answer ({exc})"
    if result.returncode != 0:
        first = (result.stderr.strip().splitlines() or ["no answer"])[0]
        return f"PostgreSQL at {PG!r} did not answer: {first} (start it, or set HEADATLAS_TEST_PG)"
    from headatlas.service.storage.backends.base import extension_directory

    if extension_directory() is None:
        return "the DuckLake extension wheels (duckdb-ext-ducklake, duckdb-ext-postgres) are not installed"
    return None


def create_database(name: str, template: str | None = None) -> None:
    sql = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
    result = _psql(sql)
    assert result.returncode == 0, result.stderr


def drop_database(name: str) -> None:
    _psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class Lake:
    """A lake: ``url`` for --db, ``data_path`` for --data-path."""

    name: str
    data_path: Path
    password: str | None = None

    @property
    def url(self) -> str:
        secret = f" password={self.password}" if self.password else ""
        return f"ducklake:postgres:dbname={self.name} {PG}{secret}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach it: HEADATLAS_DB and HEADATLAS_DATA_PATH."""
        return {"HEADATLAS_DB": self.url, "HEADATLAS_DATA_PATH": str(self.data_path)}

    def backend(self):
        from headatlas.service.storage.backends.lake import LakeBackend

        return LakeBackend(self.url, data_path=self.data_path)

    def release(self) -> None:
        """Close this process's attachment (before the database is dropped or copied)."""
        from headatlas.service.storage.backends.lake import release

        release(self.backend())


def new_lake(folder: Path, *, template: Lake | None = None) -> Lake:
    """A lake of its own: a copy of ``template`` (already migrated), or a new empty catalogue."""
    lake = Lake(f"ha_test_{uuid.uuid4().hex[:12]}", Path(folder) / "lake-data")
    if template is not None:
        template.release()
        create_database(lake.name, template.name)
        shutil.copytree(template.data_path, lake.data_path)
    else:
        create_database(lake.name)
        lake.data_path.mkdir(parents=True, exist_ok=True)
    return lake


def remove_lake(lake: Lake) -> None:
    lake.release()
    drop_database(lake.name)
    shutil.rmtree(lake.data_path, ignore_errors=True)
