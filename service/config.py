"""Settings, typed, read from ``HEADATLAS_*`` environment variables (CLI options override)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from headatlas.service.errors import ParameterError


@dataclass(frozen=True)
class Settings:
    db: str = "headatlas.duckdb"
    """HEADATLAS_DB: the results database: a DuckDB file, or a lake (ducklake:postgres:dbname=… host=…, ducklake:FILE.ducklake)."""
    data_path: str = ""
    """HEADATLAS_DATA_PATH: where a lake keeps its Parquet files (a folder or a shared mount, as this host sees it); needed when a lake is created."""
    model: str = "default"
    """HEADATLAS_MODEL: default model (`default` = all-MiniLM-L6-v2, a folder, a hub name, random:SHAPE)."""
    device: str = "auto"
    """HEADATLAS_DEVICE: auto, cpu, cuda or cuda:N."""
    batch_size: str = "32"
    """HEADATLAS_BATCH_SIZE: windows per forward pass, or auto (from free GPU memory)."""
    broker_url: str = "redis://127.0.0.1:6379/0"
    """HEADATLAS_BROKER_URL: Redis URL of the task queue (distributed runs)."""
    spool_dir: str = ""
    """HEADATLAS_SPOOL_DIR: folder shared by submitters, workers and the writer (default: next to the database)."""
    task_time_limit_s: float = 600.0
    """HEADATLAS_TASK_TIME_LIMIT_S: longest one batch's analysis may run, seconds, not counting a worker's first build of the model (a process still running at 1.5 times this is killed; the broker's visibility timeout is twice this)."""
    max_attempts: int = 3
    """HEADATLAS_MAX_ATTEMPTS: tries per batch before it is marked failed (poison guard); `headatlas retry RUN` re-queues it."""
    sql_max_rows: int = 1000
    """HEADATLAS_SQL_MAX_ROWS: row cap of `headatlas sql`."""
    sql_timeout_s: float = 30.0
    """HEADATLAS_SQL_TIMEOUT_S: time limit of `headatlas sql`, seconds."""
    attribution_chunk: int = 2048
    """HEADATLAS_ATTRIBUTION_CHUNK: gradient rows (windows × outputs) per batched backward call of --attribution; bounds memory."""
    store_every_s: float = 10.0
    """HEADATLAS_STORE_EVERY_S: how often `analyze` stores its finished batches, seconds (one transaction each; a killed run loses at most this much analysis, which the next run resumes)."""
    lease_s: float = 10.0
    """HEADATLAS_LEASE_S: how long a writer's lease, a running batch's heartbeat and a worker's beacon live unrefreshed before their process counts as gone (its messages and batches are taken over), seconds; each is refreshed every fifth of it."""

    def __post_init__(self) -> None:
        if not self.lease_s > 0:  # also refuses nan
            raise ParameterError(f"HEADATLAS_LEASE_S={self.lease_s!r}: expected seconds, more than 0")
        if not self.store_every_s >= 0:  # also refuses nan
            raise ParameterError(
                f"HEADATLAS_STORE_EVERY_S={self.store_every_s!r}: expected seconds, 0 or more (0: store every batch)"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            key = f"HEADATLAS_{f.name.upper()}"
            if key not in env:
                continue
            raw = env[key]
            kind: type = type(f.default)  # every setting has a default, whose type parses it
            try:
                values[f.name] = kind(raw)
            except ValueError:
                raise ParameterError(f"{key}={raw!r}: expected a {kind.__name__}") from None
        return cls(**values)

    @classmethod
    def default(cls, name: str):
        """The built-in value of one setting (what applies when its variable is not set)."""
        return next(f.default for f in fields(cls) if f.name == name)

    @classmethod
    def help(cls) -> list[tuple[str, str, str]]:
        """(variable, default, description) for every setting — README and `headatlas config`."""
        import inspect

        source = inspect.getsource(cls)
        out = []
        for f in fields(cls):
            marker = f'"""HEADATLAS_{f.name.upper()}: '
            start = source.index(marker) + len(marker)
            out.append((f"HEADATLAS_{f.name.upper()}", str(f.default), source[start : source.index('"""', start)]))
        return out


BROKER_SCHEMES = ("redis", "rediss", "unix")


def check_broker_url(url: str) -> str:
    """A Redis URL (redis://host:port/db, rediss://…, unix:///path/to/socket), or ParameterError."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
    except ValueError as exc:
        raise ParameterError(f"--broker {url!r} is not a URL ({exc}): use redis://HOST:6379/0") from None
    if (
        parts.scheme not in BROKER_SCHEMES
        or (parts.scheme != "unix" and not parts.hostname)
        or (parts.scheme == "unix" and not parts.path)
    ):
        raise ParameterError(
            f"--broker {url!r} is not a Redis URL: use redis://HOST:6379/0, rediss://HOST:6380/0 or "
            "unix:///path/to/redis.sock [env HEADATLAS_BROKER_URL]"
        )
    return url
