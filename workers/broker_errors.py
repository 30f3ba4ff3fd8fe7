"""Redis's refusals that are not a lost broker, as one-line errors with their fix.

A Redis at ``maxmemory`` answers reads and refuses writes (and, inside MULTI, every command) with
"OOM command not allowed"; a URL naming database 99 on a server of 16 is refused at connection
with "DB index is out of range". Both are a server that is there: telling the user it is lost
or unreachable sends them to restart a Redis that runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

from headatlas.service.errors import BrokerDatabaseOutOfRange, BrokerError, BrokerOutOfMemory


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` (or what a queue library wrapped in it) is Redis refusing a command at maxmemory."""
    while exc is not None:
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or "used memory > 'maxmemory'" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def is_database_out_of_range(exc: BaseException) -> bool:
    return isinstance(exc, redis.ResponseError) and "DB index is out of range" in str(exc)


def refusal(url: str, exc: BaseException, *, kept: str = "") -> BrokerError | None:
    """The one-line error for a Redis that refused ``exc`` although it is reachable; None when
    ``exc`` is not such a refusal (a lost connection, a timeout: the callers' own messages).
    ``kept``: what the caller can say is safe (e.g. "what was queued is kept")."""
    tail = f"; {kept}" if kept else ""
    if is_out_of_memory(exc):
        return BrokerOutOfMemory(
            f"the broker at {url} is out of memory ({_maxmemory(url)}; Redis refuses writes: OOM command not "
            "allowed): raise its maxmemory (`redis-cli CONFIG SET maxmemory 2gb`, or maxmemory in redis.conf) "
            f"or free memory in it{tail}"
        )
    if is_database_out_of_range(exc):
        return BrokerDatabaseOutOfRange(
            f"the broker URL {url} names database {_database(url)}, out of range for that Redis "
            f"({_databases(url)}): use a database number in range in the URL, or raise `databases` in redis.conf"
        )
    return None


@contextmanager
def refusals_said(url: str, *, kept: str = "") -> Iterator[None]:
    """Within the block, Redis's refusals (see :func:`refusal`) are raised as their BrokerError."""
    try:
        yield
    except redis.ResponseError as exc:
        refused = refusal(url, exc, kept=kept)
        if refused is None:
            raise
        raise refused from None


def _database(url: str) -> str:
    try:
        return str(redis.connection.parse_url(url).get("db", 0))
    except ValueError:
        return "?"


def _admin(url: str) -> redis.Redis:
    """A client of the same server on database 0 (which every server has), to ask its settings."""
    pool = redis.ConnectionPool.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    pool.connection_kwargs["db"] = 0  # the URL's own number wins over a db= argument
    return redis.Redis(connection_pool=pool)


def _databases(url: str) -> str:
    try:
        with _admin(url) as client:
            count = int(client.config_get("databases")["databases"])
        return f"it has {count}: 0 to {count - 1}"
    except (redis.RedisError, KeyError, ValueError):  # CONFIG may be renamed or refused
        return "its `databases` setting, 16 unless changed"


def _maxmemory(url: str) -> str:
    try:
        with _admin(url) as client:
            limit = int(client.config_get("maxmemory")["maxmemory"])
        return f"maxmemory {limit / 2**20:,.1f} MiB reached" if limit else "maxmemory reached"
    except (redis.RedisError, KeyError, ValueError):
        return "maxmemory reached"
