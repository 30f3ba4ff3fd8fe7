"""Read-only, time-limited, row-capped raw SQL against the results database.

Four layers keep user SQL from touching anything but the stored results (the escape table in
docs/reliability.md tries each):

1. ``check_select_only`` parses the text with DuckDB's own parser and accepts exactly one
   statement of type SELECT (``WITH … SELECT``, ``FROM t``, ``SHOW``/``DESCRIBE`` parse as
   SELECT too); IMPORT and PRAGMA are refused by their keyword.
2. ``Backend.refuse_in_sandbox`` (``sql_check.refusal``) walks the whole parse tree: table
   functions on an allow-list only (no ``query()``, ``query_table()``, ``postgres_query()``, file
   readers), no system view or table function named as a table however qualified, names passed as
   strings inspected, no PostgreSQL functions, no table of a lake's catalogue, and on a lake no
   listing that would show the catalogue.
3. ``connect_readonly`` opens the database read-only with external access disabled, extension
   autoload/autoinstall off and the configuration locked, so a file-reading SELECT the inspection
   missed still fails in the engine, and nothing can be ``SET`` back. A lake is attached read-only,
   through a private copy of its catalogue in an instance without the PostgreSQL extension
   (``LakeBackend.sandbox``), and may read files under its data path only.
4. ``run_readonly_sql`` runs the query in a confined child process (``confined.run_confined``):
   an address-space limit holds the memory limit for values DuckDB builds outside its buffer
   manager, and a kill at the deadline holds the time limit for a query that ignores interrupts.
   Layers 1 and 2 run there too, first, under bounds of their own (``CHECK_S``, ``CHECK_BYTES``):
   a statement's parse costs what its author chooses, and the caller (the web server) never pays it.

The connection is opened with the ``duckdb`` module rather than through SQLAlchemy. Both work:
duckdb-engine 0.17 passes known settings in ``connect_args["config"]`` straight to
``duckdb.connect`` (checked: the settings above read back as set). We go direct because raw
user SQL must reach DuckDB unchanged, the time limit needs the driver connection's
``interrupt()``, and SQLAlchemy would add its dialect's start-up queries and wrap every DuckDB
error in its own exception for no gain on a single SELECT.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import duckdb

from headatlas.service.errors import Param, ParameterError, StoreError
from headatlas.service.storage.confined import (
    ChildFailed,
    Marks,
    address_space_now,
    confinement,
    run_confined,
    threads_now,
)
from headatlas.service.storage.duckdb_settings import READONLY_CONFIG  # noqa: F401 - where callers found it
from headatlas.service.storage.locks import MAX_RETRY_DELAY_S, is_lock_conflict, retry_on_lock  # noqa: F401
from headatlas.service.storage.sql_check import ALLOWED as _ALLOWED
from headatlas.service.storage.sql_check import SIMPLIFY, is_too_deep, parser, refuse_import, too_deep, warm

if TYPE_CHECKING:
    from headatlas.service.storage.backends.base import Backend

T = TypeVar("T")

_LEADING_COMMENTS = re.compile(r"^(?:\s+|--[^\n\r]*(?:\r\n|\n|\r|$)|/\*.*?\*/)*", re.DOTALL)
_FIRST_WORD = re.compile(r"[A-Za-z_]+")


@dataclass
class QueryResult:
    """Rows of one query, at most ``max_rows`` of them; ``elapsed_s`` in seconds."""

    columns: list[str]
    rows: list[tuple]
    truncated: bool  # True when more rows existed than max_rows
    elapsed_s: float
    runs: int = 0  # runs in the database (whether a query without a run filter may mix several)


def check_select_only(sql: str) -> str:
    """Return ``sql`` as one SELECT statement without its trailing ';', or raise StoreError.

    Refuses empty text, several statements, any statement that is not a SELECT (DDL, DML,
    COPY, ATTACH, INSTALL/LOAD, SET/RESET, PRAGMA, EXPORT/IMPORT, CALL, CHECKPOINT, VACUUM …)
    and text DuckDB cannot parse. What a SELECT may call is checked by ``sql_check.refusal``.
    """
    refuse_import(sql)  # DuckDB 1.4's parser opens IMPORT DATABASE's folder: refused unparsed
    try:
        statements = parser().extract_statements(sql)
    except duckdb.ParserException as error:
        if is_too_deep(error):  # its message says SET max_expression_depth, which sql refuses
            raise StoreError(f"refused: {too_deep(_first_word(sql))}") from None
        raise StoreError(f"refused: SQL syntax error: {_first_line(error)}") from error
    except duckdb.OutOfMemoryException:
        raise StoreError(f"refused: {_INSPECTION_MEMORY}") from None
    except duckdb.Error as error:
        raise StoreError(f"refused: SQL could not be parsed: {_first_line(error)}") from error

    if not statements:
        raise StoreError(f"refused: no SQL statement given; {_ALLOWED}")
    if len(statements) > 1:
        kinds = ", ".join(_statement_kind(s) for s in statements)
        raise StoreError(f"refused: {_ALLOWED}; got {len(statements)} statements ({kinds})")
    statement = statements[0]
    kind = _statement_kind(statement)
    if _first_word(sql) == "PRAGMA":
        kind = "PRAGMA"  # the parser hands PRAGMA database_list back as SELECT * FROM pragma_database_list
    if _statement_type(statement) != "SELECT" or kind == "PRAGMA":
        raise StoreError(f"refused: {_ALLOWED}; got {kind}")
    return statement.query.strip().rstrip(";").rstrip()


DEFAULT_MEMORY_MAX = 2 * 2**30  # a query's default memory, at most: DuckDB spills past it (temp_limit)


def default_memory_limit() -> str:
    """A quarter of this machine's memory, at most 2 GiB (``DEFAULT_MEMORY_MAX``; a web server runs
    several queries) and at most what this process's address-space limit leaves (a shell's ``ulimit
    -v``), at least 256 MB: one query cannot take the machine."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4 * DEFAULT_MEMORY_MAX
    memory = min(total // 4, DEFAULT_MEMORY_MAX)
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limits = [x for x in (soft, hard) if x != resource.RLIM_INFINITY]
    if limits:
        memory = min(memory, (min(limits) - address_space_now()) // 2)
    return f"{max(256, memory // 2**20)}MiB"


DEFAULT_TEMP_LIMIT = "4GB"  # what a query may spill to disk
DEFAULT_MAX_BYTES = 64 * 2**20  # what one answer may hold (its values' bytes), unless told otherwise


def _limits(memory_limit: str | None, temp_limit: str | None) -> dict[str, str]:
    out = {}
    for option, name, value in (
        ("memory_limit", "memory_limit", memory_limit),
        ("temp_limit", "max_temp_directory_size", temp_limit),
    ):
        if value is None:
            continue
        if not re.fullmatch(r"\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*", value, re.IGNORECASE):
            raise ParameterError(Param(option, value, quoted=True), ": use a size such as 512MB or 2GB")
        out[name] = value.strip()
    return out


@contextmanager
def connect_readonly(
    db_path, *, lock_wait_s: float = 10.0, limits: dict[str, str] | None = None, at: int | None = None
) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open the results database read-only and confined to it; close it on exit. ``db_path``: a
    path, a ``ducklake:…`` URL or a backend. ``limits``: DuckDB settings set before the
    configuration is locked (memory, spill). ``at``: as of that snapshot (a lake)."""
    from headatlas.service.storage.backends import open_backend

    with open_backend(db_path).sandbox(limits=limits, lock_wait_s=lock_wait_s, at=at) as connection:
        yield connection


def run_readonly_sql(
    db_path,
    sql: str,
    *,
    params: dict | list | None = None,
    max_rows: int = 1000,
    timeout_s: float = 30.0,
    lock_wait_s: float = 10.0,
    memory_limit: str | None = None,
    temp_limit: str | None = DEFAULT_TEMP_LIMIT,
    run_id: int | None = None,
    at: int | None = None,
    max_bytes: int | str | None = DEFAULT_MAX_BYTES,
) -> QueryResult:
    """Run one SELECT on the database ``db_path`` (a path, a ``ducklake:…`` URL or a backend),
    as of snapshot ``at`` when given (a lake).

    ``params`` fill ``$name`` (dict) or ``?`` (list) placeholders. At most ``max_rows`` rows
    come back (``truncated`` says whether more existed), of at most ``max_bytes`` (bytes, or a
    size such as ``256MB``; None: no cap) of values: past it the query is stopped (StoreError), as
    its rows are fetched, in its own process. The query is interrupted after
    ``timeout_s`` seconds; a writer's lock is waited out for up to ``lock_wait_s`` seconds.
    ``run_id``: every table and view with a ``run_id`` column, and ``windows`` / ``documents``,
    show that run's rows alone (``scope_to_run``). A refused or failed query raises StoreError;
    a bad cap or time limit, ParameterError.
    """
    if max_rows < 0:
        raise ParameterError(f"max_rows must be 0 or more, got {max_rows}")
    from headatlas.service.config import SQL_TIMEOUT_MAX_S

    # nan compares false: it would disable the limit; past a day, a lake may have deleted the files
    # of the snapshot the query reads (backends.lake_compaction.FILES_GRACE_S)
    if not (math.isfinite(timeout_s) and 0 < timeout_s <= SQL_TIMEOUT_MAX_S):
        raise ParameterError(
            Param("timeout_s", timeout_s),
            f": pass a finite number of seconds, more than 0 and at most {SQL_TIMEOUT_MAX_S:.0f} (a day), e.g. ",
            Param("timeout_s", 30),
        )
    from headatlas.service.storage.backends import open_backend

    refuse_oversized(sql)
    backend = open_backend(db_path)
    if not backend.confines_sql:
        raise StoreError(
            Param("db", backend.label),
            f": the {backend.kind} backend ({backend.origin}) cannot confine the sql sandbox to its database, so sql "
            "refuses it; read it with query, report or headatlas.connect(…).heads(), or copy it to a file first "
            "(`headatlas db copy`)",
        )
    limits = _limits(memory_limit or default_memory_limit(), temp_limit)
    cap = _max_bytes(max_bytes)
    from headatlas.service.config import Settings

    threads = Settings.from_env().sql_threads or os.cpu_count() or 1  # HEADATLAS_SQL_THREADS
    query = _SandboxQuery(backend, sql, params, max_rows, timeout_s, lock_wait_s, limits, threads, run_id, at, cap)
    if confinement() is None and threads_now() == 1:
        warm()  # this process forks the query's: its children find DuckDB's names known
    try:
        return run_confined(
            query,
            memory_bytes=_bytes(limits["memory_limit"]),
            threads=threads,
            timeout_s=timeout_s,
            setup_s=lock_wait_s + SETUP_S,
            check_s=CHECK_S,
            check_bytes=CHECK_BYTES,
        )
    except ChildFailed as failed:
        if failed.stage == "check":
            raise StoreError(
                f"refused: the statement could not be inspected within sql's bounds ({failed}; at most "
                f"{CHECK_S:g} s and {CHECK_BYTES >> 20} MB): {_SMALLER}"
            ) from None
        if failed.timed_out:
            raise StoreError(str(failed), hint=("narrow it or pass ", Param("timeout_s"))) from None
        raise StoreError(
            f"query stopped: {failed} (memory limit {limits['memory_limit']})",
            hint=("narrow it or pass ", Param("memory_limit")),
        ) from None


# A statement is inspected in the query's own process, before it connects (``_SandboxQuery``): its
# parse takes time and memory quadratic in its CTEs (2,000 took 59 s and 3.4 GB), so the inspection
# has bounds of its own, whatever the query's limits; and text longer than anyone types is refused
# before a process starts
MAX_STATEMENT_CHARS = 100_000
_SMALLER = f"{SIMPLIFY} (fewer CTEs, terms or levels)"
_INSPECTION_MEMORY = f"inspecting the statement needs more memory than sql gives it: {_SMALLER}"
CHECK_S = 10.0  # a statement's parse and inspection take milliseconds
CHECK_BYTES = 256 * 2**20  # ... and a few MB (400 CTEs: 120 MB)


def refuse_oversized(sql: str) -> None:
    """Raise StoreError when ``sql`` is longer than ``MAX_STATEMENT_CHARS``."""
    if len(sql) > MAX_STATEMENT_CHARS:
        raise StoreError(
            f"refused: the statement is {len(sql):,} characters long, more than sql takes ({MAX_STATEMENT_CHARS:,}): "
            "shorten it"
        )


def check_statement(sql: str, backend: Backend) -> str:
    """``sql`` as the one SELECT the sandbox runs (``check_select_only``), once the backend's
    inspection (``Backend.refuse_in_sandbox``) finds nothing to refuse; else StoreError."""
    try:
        statement = check_select_only(sql)
        refused = backend.refuse_in_sandbox(statement, keyword=_first_word(statement))
    except MemoryError:
        refused = _INSPECTION_MEMORY
    if refused:
        if refused.endswith(SIMPLIFY):  # its size or depth: what is allowed is not the point
            raise StoreError(f"refused: {refused}")
        raise StoreError(f"refused: {refused}; {_ALLOWED} over the results' tables and views")
    return statement


@dataclass(frozen=True)
class _SandboxQuery:
    """One SELECT as the confined child checks and runs it (``confined.run_confined``); it pickles,
    for a child that a clean helper starts."""

    backend: Backend
    sql: str
    params: dict | list | None
    max_rows: int
    timeout_s: float
    lock_wait_s: float
    limits: dict[str, str]
    threads: int
    run_id: int | None
    at: int | None
    max_bytes: int | None = DEFAULT_MAX_BYTES

    def __call__(self, marks: Marks) -> QueryResult:
        statement = check_statement(self.sql, self.backend)  # under the check's own bounds
        marks.checked()
        limits = dict(self.limits)
        if marks.memory_bytes is not None and marks.memory_bytes < _bytes(limits["memory_limit"]):
            # an address-space limit this process inherited (ulimit -v) leaves less: DuckDB keeps under it
            if marks.memory_bytes < MIN_MEMORY:
                raise StoreError(
                    f"query stopped: this process's address-space limit (ulimit -v) leaves the query "
                    f"{marks.memory_bytes >> 20} MB: raise it"
                )
            limits["memory_limit"] = f"{marks.memory_bytes}B"
        # a temporary folder of its own, so that the engine's spill folder (which external-access
        # rules let it read) holds nothing but its own
        with tempfile.TemporaryDirectory(prefix="headatlas-sql-") as spill:
            settings = {**limits, "temp_directory": spill, "threads": str(self.threads)}
            with connect_readonly(
                self.backend, lock_wait_s=self.lock_wait_s, limits=settings, at=self.at
            ) as connection:
                return _execute(
                    connection,
                    statement,
                    self.params,
                    self.max_rows,
                    self.timeout_s,
                    self.run_id,
                    marks,
                    max_bytes=self.max_bytes,
                )


MIN_MEMORY = 64 * 2**20  # the least a query may run with
SETUP_S = 60.0  # connecting (a lake attaches its catalogue) before a query's time limit starts


def _execute(
    connection: duckdb.DuckDBPyConnection,
    statement: str,
    params: dict | list | None,
    max_rows: int,
    timeout_s: float,
    run_id: int | None,
    started: Callable[[], None],
    *,
    max_bytes: int | None = None,
) -> QueryResult:
    runs = _count_runs(connection)
    if run_id is not None:
        scope_to_run(connection, run_id, statement)
    deadline = _Deadline(connection, timeout_s)
    started()
    began = time.perf_counter()
    try:
        with deadline:
            if params is None:
                cursor = connection.execute(statement)
            else:
                cursor = connection.execute(statement, params)
            columns = [column[0] for column in cursor.description or []]
            # One row past the cap tells us whether the result was cut.
            rows = _fetch(cursor, max_rows + 1, max_bytes)
    except duckdb.Error as error:
        if deadline.fired:
            raise StoreError(
                f"query stopped after {timeout_s:g} s (time limit)", hint=("narrow it or pass ", Param("timeout_s"))
            ) from None
        if isinstance(error, duckdb.OutOfMemoryException):
            raise StoreError(
                f"query stopped: it needs more memory than its limit ({_first_line(error)})",
                hint=("narrow it or pass ", Param("memory_limit")),
            ) from None
        raise StoreError(f"query failed: {_first_line(error)}") from None
    except MemoryError:
        raise StoreError(
            "query stopped: it needs more memory than its limit", hint=("narrow it or pass ", Param("memory_limit"))
        ) from None
    return QueryResult(
        columns=columns,
        rows=rows[:max_rows],
        truncated=len(rows) > max_rows,
        elapsed_s=time.perf_counter() - began,
        runs=runs,
    )


_FETCH_ROWS = 1000  # rows fetched at a time, each batch's size counted before the next


def _max_bytes(value: int | str | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, str):
        return _bytes(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParameterError(Param("max_bytes", value), ": pass a number of bytes (1 or more) or a size such as 256MB")
    return value


def _fetch(cursor: duckdb.DuckDBPyConnection, rows_wanted: int, max_bytes: int | None) -> list[tuple]:
    """At most ``rows_wanted`` rows, fetched a batch at a time (DuckDB streams them: the query stops
    where the fetching does), or StoreError once their values pass ``max_bytes``. A batch is as
    many rows as half the room left holds, at the rows' mean size so far."""
    rows: list[tuple] = []
    size, batch = 0, 16
    while len(rows) < rows_wanted:
        fetched = cursor.fetchmany(min(batch, rows_wanted - len(rows)))
        if not fetched:
            break
        rows.extend(fetched)
        if max_bytes is None:
            batch = _FETCH_ROWS
            continue
        size += sum(_size(row) for row in fetched)
        if size > max_bytes:
            raise StoreError(
                f"query stopped: its answer passed {_human(max_bytes)} (the cap on an answer's size) after "
                f"{len(rows):,} rows",
                hint=("add LIMIT, select fewer or shorter columns, or pass ", Param("max_bytes")),
            )
        batch = int(max(1, min(_FETCH_ROWS, (max_bytes - size) / 2 / (size / len(rows)))))
    return rows


def _size(value: object) -> int:
    """About what ``value`` takes in an answer: a string's or blob's length, 8 bytes a number."""
    if isinstance(value, (str, bytes, bytearray, memoryview)):
        return len(value) + 8
    if isinstance(value, (tuple, list, set)):
        return 8 + sum(_size(item) for item in value)
    if isinstance(value, dict):
        return 8 + sum(_size(k) + _size(v) for k, v in value.items())
    return 8


def _human(size: int) -> str:
    """``size`` as it was most likely written: 64 MiB, 1 MB, else in bytes."""
    for units in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)), (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        for unit, scale in units:
            if size >= scale and size % scale == 0:
                return f"{size // scale:,} {unit}"
    return f"{size:,} bytes"


_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def _bytes(size: str) -> int:
    """A size as ``_limits`` accepts it (``512MB``, ``2GiB``) in bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*", size)
    if not match or match.group(2).upper() not in _UNITS:
        raise ParameterError(f"{size!r}: use a size such as 512MB or 2GB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _first_word(statement: str) -> str:
    match = _FIRST_WORD.match(_LEADING_COMMENTS.sub("", statement, count=1))
    return match.group(0).upper() if match else "SELECT"


def scope_to_run(connection: duckdb.DuckDBPyConnection, run_id: int, statement: str | None = None) -> None:
    """Shadow, for this connection only, every table and view with a ``run_id`` column by a
    temporary view of one run's rows, and ``windows`` / ``documents`` by the run's own: a plain
    ``SELECT … FROM head_metrics`` then reads that run alone. A convenience for reading one
    run, not an access control: a table named in full (``<database>.main.<table>``) is whole.

    Given the ``statement`` that will run, only the names it can reach are shadowed: those it
    writes and, through the views' definitions, those they read (``_reached``), which is every
    name that shadowing resolves differently. Making a temporary view plans its body, and the
    metric views' bodies are the whole chain of views (about 0.1 s for all of them in one query's
    process). A statement that lists the catalogue (the information schema, ``duckdb_…`` and
    ``pragma_…`` functions, SHOW, DESCRIBE, SUMMARIZE) has every name shadowed, as it sees them."""
    catalog = connection.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
    main = '"' + catalog.replace('"', '""') + '".main'
    # no bound parameter: binding a Python value makes DuckDB import pandas (seconds, in every query's process)
    names = [
        r[0]
        for r in connection.execute(
            "SELECT DISTINCT table_name FROM information_schema.columns "
            "WHERE table_catalog = current_database() AND table_schema = 'main' AND column_name = 'run_id' ORDER BY 1"
        ).fetchall()
    ]
    run = int(run_id)
    mine = f"SELECT window_id FROM {main}.run_windows WHERE run_id = {run}"
    scoped = {name: f"SELECT * FROM {main}.{_quoted(name)} WHERE run_id = {run}" for name in names}
    if "run_windows" in names:
        scoped["windows"] = f"SELECT * FROM {main}.windows WHERE window_id IN ({mine})"
        scoped["documents"] = (
            f"SELECT * FROM {main}.documents WHERE doc_id IN "
            f"(SELECT doc_id FROM {main}.windows WHERE window_id IN ({mine}))"
        )
    if statement is not None:
        reached = _reached(connection, statement)
        if reached is not None:
            scoped = {name: body for name, body in scoped.items() if name.lower() in reached}
    for name, body in scoped.items():
        connection.execute(f"CREATE TEMP VIEW {_quoted(name)} AS {body}")


_WORD = re.compile(r"[^\W\d][\w$]*")  # an identifier, in any script
# words of a statement that lists the catalogue, where temporary views show up as entries of their own
_LISTING_WORDS = frozenset({"information_schema", "show", "describe", "summarize", "sqlite_master"})
_LISTING_PREFIXES = ("duckdb_", "pragma_", "pg_", "sqlite_")


def _reached(connection: duckdb.DuckDBPyConnection, statement: str) -> set[str] | None:
    """The names (lower case) ``statement`` may read, directly or through the views of the
    connection's database; None when it lists the catalogue. A word of the statement or of a
    view's definition counts as a name wherever it stands (in a string, as a column): more names
    than are read, never fewer."""
    words = {word.lower() for word in _WORD.findall(statement)}
    if words & _LISTING_WORDS or any(word.startswith(_LISTING_PREFIXES) for word in words):
        return None
    views = {
        str(name).lower(): {word.lower() for word in _WORD.findall(str(sql))}
        for name, sql in connection.execute(
            "SELECT view_name, sql FROM duckdb_views() "
            "WHERE database_name = current_database() AND schema_name = 'main' AND NOT internal"
        ).fetchall()
    }
    reached: set[str] = set()
    todo = list(words)
    while todo:
        word = todo.pop()
        if word in reached:
            continue
        reached.add(word)
        todo.extend(views.get(word, ()))
    return reached


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _count_runs(connection: duckdb.DuckDBPyConnection) -> int:
    try:
        row = connection.execute("SELECT count(*) FROM runs").fetchone()
    except duckdb.Error:  # not a headatlas database (yet): the query itself will say what is wrong
        return 0
    return int(row[0]) if row else 0


class _Deadline:
    """Interrupts a connection's running query once ``timeout_s`` seconds have passed.

    The lock keeps the timer from interrupting after the block has ended (the next query, or a
    closed connection).
    """

    def __init__(self, connection: duckdb.DuckDBPyConnection, timeout_s: float) -> None:
        self._connection = connection
        self._timer = threading.Timer(timeout_s, self._interrupt)
        self._timer.daemon = True
        self._lock = threading.Lock()
        self._done = False
        self.fired = False

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            self._done = True
        self._timer.cancel()

    def _interrupt(self) -> None:
        with self._lock:
            if self._done:
                return
            self.fired = True
            self._connection.interrupt()


def _statement_kind(statement: duckdb.Statement) -> str:
    """The keyword the user wrote (IMPORT, CHECKPOINT …), which DuckDB files under broader
    types (PRAGMA, CALL …); the statement type when the text starts with WITH or '('."""
    text = _LEADING_COMMENTS.sub("", statement.query, count=1)
    match = _FIRST_WORD.match(text)
    if match and match.group(0).upper() != "WITH":
        return match.group(0).upper()
    return _statement_type(statement)


def _statement_type(statement: duckdb.Statement) -> str:
    try:
        return statement.type.name
    except ValueError:
        # duckdb 2.0.1's Python enum lacks some kinds (UPDATE EXTENSIONS raises "29 is not a
        # valid StatementType" on .type); such a statement is not a SELECT either.
        return "statement of another kind"


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
