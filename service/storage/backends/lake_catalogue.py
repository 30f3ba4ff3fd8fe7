"""How a lake's catalogue is named: the ``ducklake:`` URL, the alias a lake is attached as, its
PostgreSQL connection string (parsed, written back, given libpq's bounds) and a catalogue password
kept out of every message.

A password is taken out of the connection string (the lake backend puts it in a DuckDB secret);
``redact`` replaces it, and any ``password=`` or URI password, by ``***`` in a message.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from headatlas.service.errors import StoreUnavailable

PREFIX = "ducklake:"
ALIAS = "lake"
METADATA = f"__ducklake_metadata_{ALIAS}"

# libpq's bounds on the catalogue's connection, unless the connection string sets its own: a
# server that accepts and never completes the startup handshake (a hung server, a proxy that
# stalls) fails the attach after connect_timeout with libpq's "timeout expired", which
# lake_errors.lake_fault knows (the writer pauses and tries again), instead of waiting for ever.
# On an established session, keepalives end one whose peer is gone (a host down, a dropped
# network: no ACK to the probes after about idle + interval × count = 60 s) and tcp_user_timeout
# one whose sent data stays unacknowledged for 30 s (libpq ≥ 12). None bounds a peer that
# acknowledges and never answers: DuckDB's PostgreSQL extension waits in a blocking PQexec, with
# no query timeout of its own and deaf to DuckDB's interrupt (statement_timeout in options bounds
# only the server's own work, which never starts then).
CATALOGUE_BOUNDS: dict[str, str] = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
    "tcp_user_timeout": "30000",
}


def is_lake_url(url: str) -> bool:
    return str(url).startswith(PREFIX)


def parse_conninfo(text_: str) -> dict[str, str]:
    """A libpq connection string (``key=value …``, values optionally single-quoted) or URI
    (``postgresql://user:password@host:port/dbname?key=value``) as a dict."""
    if text_.startswith(("postgresql://", "postgres://")):
        parts = urlsplit(text_)
        out: dict[str, str] = {}
        if parts.hostname:
            out["host"] = parts.hostname
        if parts.port:
            out["port"] = str(parts.port)
        if parts.username:
            out["user"] = unquote(parts.username)
        if parts.password:
            out["password"] = unquote(parts.password)
        if parts.path.strip("/"):
            out["dbname"] = unquote(parts.path.strip("/"))
        for pair in filter(None, parts.query.split("&")):
            key, _, value = pair.partition("=")
            out[unquote(key)] = unquote(value)
        return out
    out = {}
    pos, n = 0, len(text_)
    while pos < n:
        while pos < n and text_[pos].isspace():
            pos += 1
        if pos >= n:
            break
        match = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=\s*").match(text_, pos)
        if match is None:
            raise ValueError(f"expected key=value at {text_[pos : pos + 20]!r}")
        key, pos = match.group(1), match.end()
        if pos < n and text_[pos] == "'":
            pos += 1
            chars: list[str] = []
            while pos < n and text_[pos] != "'":
                if text_[pos] == "\\" and pos + 1 < n:
                    pos += 1
                chars.append(text_[pos])
                pos += 1
            if pos >= n:
                raise ValueError(f"unterminated quote in the value of {key}")
            pos += 1
            out[key] = "".join(chars)
        else:
            start = pos
            while pos < n and not text_[pos].isspace():
                pos += 1
            out[key] = text_[start:pos]
    return out


def format_conninfo(values: dict[str, str]) -> str:
    def quote(value: str) -> str:
        if value and not re.search(r"[\s'\\]", value):
            return value
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"

    return " ".join(f"{k}={quote(v)}" for k, v in values.items())


def bounded_conninfo(conninfo: str) -> str:
    """``conninfo`` with ``CATALOGUE_BOUNDS`` added where it sets none of its own."""
    values = parse_conninfo(conninfo)
    return format_conninfo({**values, **{k: v for k, v in CATALOGUE_BOUNDS.items() if k not in values}})


def sql_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def data_folder(path: str) -> str:
    """A data path as DuckLake wants it: absolute for a local folder, ending in a slash."""
    if "://" not in path:
        path = str(Path(path).expanduser().absolute())
    return path if path.endswith("/") else path + "/"


def redact(message: str, password: str | None) -> str:
    """``message`` with any password in it (``password``, and any written as ``password=…`` or in
    a URI) replaced by ***."""
    message = re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", message)
    message = re.sub(r"(postgres(?:ql)?://[^:/@\s]*:)[^@\s]*@", r"\1***@", message)
    if password:
        message = message.replace(password, "***")
    return message


def redact_fault(fault: StoreUnavailable, password: str | None) -> StoreUnavailable:
    """``fault`` as it may be shown: the same, or, when it holds ``password``, redacted."""
    if password and password in str(fault) + fault.cause:
        return StoreUnavailable(
            redact(str(fault), password), waits_for=fault.waits_for, cause=redact(fault.cause, password)
        )
    return fault
