"""Settings, typed, read from ``HEADATLAS_*`` environment variables (CLI options override)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from headatlas.service.errors import ParameterError
from headatlas.service.storage.duckdb_settings import THREADS_ALLOWED, THREADS_MAX


@dataclass(frozen=True)
class Allowed:
    """The values a setting takes: ``kind`` parses the variable's text; numbers lie in [low, high]
    (``low_open``: strictly above low) and are finite; text matches ``pattern`` when one is given.
    ``text`` says it in words, for the error line, `headatlas config` and docs/configuration.md."""

    kind: type
    text: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    pattern: str | None = None

    def parse(self, raw: str):
        try:
            return self.kind(raw)
        except ValueError:
            raise ValueError(self.text) from None

    def problem(self, value) -> str | None:
        """Why ``value`` is not allowed, or None."""
        if self.kind in (int, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                return self.text
            if self.low is not None and (value <= self.low if self.low_open else value < self.low):
                return self.text
            if self.high is not None and value > self.high:
                return self.text
            return None
        if not isinstance(value, str) or (self.pattern is not None and not re.fullmatch(self.pattern, value)):
            return self.text
        return None


def setting(default, allowed: Allowed) -> Any:
    """A settings field: its default and the values it allows, declared together."""
    return field(default=default, metadata={"allowed": allowed})


WEEK_S = 7 * 86400
SQL_TIMEOUT_MAX_S = 86400.0  # the longest `sql` may run (a lake keeps the files a query may read this long and more)
PRINTABLE = r"[^\x00-\x1f\x7f]*"  # a path or name: no control character (a newline, a tab, an escape)
# a shorter lease is refreshed every few milliseconds: Redis refuses a lease under 1 ms (the writer
# crashed as it started) and one of 1 ms lapsed between refreshes (the writer warned 43 times a second)
LEASE_MIN_S = 1.0
FOLDER = Allowed(str, "a folder path, or empty (no control characters)", pattern=PRINTABLE)


@dataclass(frozen=True)
class Settings:
    db: str = setting(
        "headatlas.duckdb",
        Allowed(
            str, "a file path or ducklake:…, not empty (no control characters)", pattern=rf"{PRINTABLE}\S{PRINTABLE}"
        ),
    )
    """HEADATLAS_DB: the results database: a DuckDB file, or a lake (ducklake:postgres:dbname=… host=…, ducklake:FILE.ducklake)."""
    data_path: str = setting("", FOLDER)
    """HEADATLAS_DATA_PATH: where a lake keeps its Parquet files (a folder or a shared mount, as this host sees it); needed when a lake is created."""
    model: str = setting(
        "default",
        Allowed(
            str,
            "a model name, folder or random:SHAPE, not empty (no control characters)",
            pattern=rf"{PRINTABLE}\S{PRINTABLE}",
        ),
    )
    """HEADATLAS_MODEL: default model (`default` = all-MiniLM-L6-v2, a folder, a hub name, random:SHAPE)."""
    device: str = setting("auto", Allowed(str, "auto, cpu, cuda or cuda:N", pattern=r"auto|cpu|cuda|cuda:\d+"))
    """HEADATLAS_DEVICE: auto, cpu, cuda or cuda:N."""
    batch_size: str = setting("32", Allowed(str, "auto or an integer, 1 or more", pattern=r"\s*(auto|0*[1-9]\d*)\s*"))
    """HEADATLAS_BATCH_SIZE: windows per forward pass, or auto (from free memory: the GPU's, or the system's on CPU)."""
    broker_url: str = setting(
        "redis://127.0.0.1:6379/0", Allowed(str, "redis://HOST:PORT/DB, rediss://… or unix:///path/to/redis.sock")
    )
    """HEADATLAS_BROKER_URL: Redis URL of the task queue (distributed runs)."""
    spool_dir: str = setting("", FOLDER)
    """HEADATLAS_SPOOL_DIR: folder shared by submitters, workers and the writer (default: next to the database)."""
    task_time_limit_s: float = setting(
        600.0, Allowed(float, "seconds, more than 0 and at most 604800 (a week)", low=0, high=WEEK_S, low_open=True)
    )
    """HEADATLAS_TASK_TIME_LIMIT_S: longest one batch's analysis may run, seconds, not counting a worker's first build of the model (a process still running at 1.5 times this is killed; the broker's visibility timeout is twice this)."""
    max_attempts: int = setting(3, Allowed(int, "an integer from 1 to 100", low=1, high=100))
    """HEADATLAS_MAX_ATTEMPTS: tries per batch before it is marked failed (poison guard); `headatlas retry RUN` re-queues it."""
    sql_max_rows: int = setting(1000, Allowed(int, "an integer from 1 to 100000000", low=1, high=100_000_000))
    """HEADATLAS_SQL_MAX_ROWS: row cap of `headatlas sql`."""
    sql_timeout_s: float = setting(
        30.0,
        Allowed(float, "seconds, more than 0 and at most 86400 (a day)", low=0, high=SQL_TIMEOUT_MAX_S, low_open=True),
    )
    """HEADATLAS_SQL_TIMEOUT_S: time limit of `headatlas sql`, seconds."""
    sql_threads: int = setting(0, Allowed(int, "an integer from 0 to 1024 (0: the machine's cores)", low=0, high=1024))
    """HEADATLAS_SQL_THREADS: threads one `sql` statement may use (a server's page runs at most two at once); 0: as many as the machine has cores."""
    attribution_chunk: int = setting(2048, Allowed(int, "an integer from 1 to 16777216", low=1, high=2**24))
    """HEADATLAS_ATTRIBUTION_CHUNK: gradient rows (windows × outputs) per batched backward call of --attribution; bounds memory."""
    store_every_s: float = setting(
        10.0, Allowed(float, "seconds, 0 or more and at most 86400 (0: store every batch)", low=0, high=86400)
    )
    """HEADATLAS_STORE_EVERY_S: how often `analyze` stores its finished batches, seconds (one transaction each; a killed run loses at most this much analysis, which the next run resumes)."""
    prepare_processes: int = setting(0, Allowed(int, "an integer from 0 to 1024 (0: automatic)", low=0, high=1024))
    """HEADATLAS_PREPARE_PROCESSES: processes that tokenise, segment and window the corpus (`analyze`: 0 = the cores left beside the model, where two or more are left, else the run's own; `submit`: 0 = every core; 1 = the calling process)."""
    lease_s: float = setting(
        10.0, Allowed(float, "seconds, at least 1 and at most 3600 (an hour)", low=LEASE_MIN_S, high=3600)
    )
    """HEADATLAS_LEASE_S: how long a writer's lease, a running batch's heartbeat and a worker's beacon live unrefreshed before their process counts as gone (its messages and batches are taken over), seconds; each is refreshed every fifth of it."""

    duckdb_threads: int = setting(0, Allowed(int, THREADS_ALLOWED, low=0, high=THREADS_MAX))
    """HEADATLAS_DUCKDB_THREADS: threads of each DuckDB connection headatlas opens (0: DuckDB's own choice, one per core); 1 where several processes share few cores, as the test suite's do (a second thread there costs more CPU than it saves time)."""

    cache: str = setting("", FOLDER)
    """HEADATLAS_CACHE: where GGUF models are kept once converted (default: $XDG_CACHE_HOME/headatlas, else ~/.cache/headatlas)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = self.problem(f.name, getattr(self, f.name))
            if problem is not None:
                raise ParameterError(f"{variable(f.name)}={shown(f.name, getattr(self, f.name))!r}: expected {problem}")

    @classmethod
    def problem(cls, name: str, value) -> str | None:
        """Why ``value`` is not allowed for setting ``name`` (the allowed values), or None."""
        if name == "broker_url":
            try:
                check_broker_url(value)
            except ParameterError:
                return allowed(name).text
            return None
        return allowed(name).problem(value)

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """(values set by the environment, by field name; why each bad variable is refused, by
        variable): the whole picture, for `headatlas config`, which shows every setting."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        bad: dict[str, str] = {}
        for f in fields(cls):
            key = variable(f.name)
            if key not in env:
                continue
            raw = env[key]
            try:
                value = allowed(f.name).parse(raw)
            except ValueError as exc:
                bad[key] = f"{key}={shown(f.name, raw)!r}: expected {exc}"
                continue
            problem = cls.problem(f.name, value)
            if problem is not None:
                bad[key] = f"{key}={shown(f.name, raw)!r}: expected {problem}"
                continue
            values[f.name] = value
        return values, bad

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        values, bad = cls.read(environ)
        if bad:
            raise ParameterError(next(iter(bad.values())))
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
            marker = f'"""{variable(f.name)}: '
            start = source.index(marker) + len(marker)
            out.append((variable(f.name), str(f.default), source[start : source.index('"""', start)]))
        return out


def shown(name: str, value):
    """A setting's value as messages print it: a lake's catalogue password never is."""
    if name != "db" or not isinstance(value, str):
        return value
    from headatlas.service.storage.backends import label

    return label(value)


def variable(name: str) -> str:
    return f"HEADATLAS_{name.upper()}"


def allowed(name: str) -> Allowed:
    """The values setting ``name`` allows, as declared next to its default."""
    return next(f.metadata["allowed"] for f in fields(Settings) if f.name == name)


def check_values(environ: Mapping[str, str]) -> tuple[list[tuple], list[str]]:
    """(variable, value, default, check, meaning) for every setting, and the variables whose
    value is refused (check: ``BAD: the reason``)."""
    values, bad = Settings.read(environ)
    rows = []
    for var, default, meaning in Settings.help():
        name = var[len("HEADATLAS_") :].lower()
        raw = environ[var] if var in bad else values.get(name, Settings.default(name))
        check = f"BAD: expected {bad[var].split(': expected ', 1)[1]}" if var in bad else "ok"
        rows.append((var, str(shown(name, raw)), default, check, meaning))
    return rows, list(bad)


def check_setting(name: str, value, *, flag: str | None = None):
    """``value`` of setting ``name`` (from its option or its variable), or a one-line ParameterError."""
    if name == "broker_url":
        return check_broker_url(value)  # its own line names the URL forms
    problem = Settings.problem(name, value)
    if problem is not None:
        where = (
            f"{flag} {shown(name, value)!r} (or {variable(name)})"
            if flag
            else f"{variable(name)}={shown(name, value)!r}"
        )
        raise ParameterError(f"{where}: expected {problem}")
    return value


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
