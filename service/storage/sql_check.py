"""What user SQL may say before it reaches the sandbox: one SELECT, reading the results alone.

The engine's settings (``duckdb_settings.READONLY_CONFIG``: no external access, locked configuration)
stop a SELECT from reading files or changing settings, but not from running SQL that it carries
as a string: ``query('…')`` and ``query_table('…')`` run text the statement check never saw, and
DuckDB's system views (``duckdb_databases``, ``pragma_database_list``) show the databases'
paths and connection strings. So the whole parse tree is inspected, every node of every subquery:

- **table functions** (called with parentheses, or named bare as a table: ``FROM duckdb_databases``
  reaches its system view) must be on an allow-list (``TABLE_FUNCTIONS``, plus a backend's own
  readers, ``Backend.sandbox_table_functions``): ``query``, ``query_table``, ``postgres_query``,
  ``postgres_scan``, ``json_execute_serialized_sql``, ``duckdb_databases``, the file readers and
  every function added later are refused;
- **tables** named like one of DuckDB's system views or table functions are refused whatever their
  qualifiers, quotes or case (``main.duckdb_databases``, ``system.main.…``, ``temp.main.…``,
  ``pg_catalog.pg_settings``): no results table has such a name; the information schema is open
  where nothing is hidden;
- **names passed as strings** (``pragma_table_info('t')``, DuckLake's listings) must be literals,
  inspected like tables the statement named; ``current_setting``, ``nextval``, ``currval`` and the
  SQL (de)serialisers are refused;
- **scalar functions** named ``postgres_*`` / ``pg_*`` (but ``pg_typeof``) are refused;
- **a hidden catalogue** (a lake's ``__ducklake_metadata_*``) is refused wherever it is named,
  however quoted, and where a backend hides one the listings of every database (``LISTINGS``, the
  information schema, SHOW ALL TABLES) are refused, since they would list it;
- ``SHOW DATABASES`` is refused (connection strings), and a statement that cannot be serialised
  for inspection is refused rather than run unseen.

On a lake the PostgreSQL extension is not even loaded where the SQL runs (``LakeBackend.sandbox``):
what reaches the catalogue's server does not rest on this inspection.

Text the parser itself opens is stopped before parsing: ``IMPORT DATABASE`` reads the folder's
``schema.sql`` while being parsed, so the statement starts are found with DuckDB's tokenizer
(which knows every comment form, ``\\r`` line ends included) and an IMPORT anywhere is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from typing import Any

import duckdb

from headatlas.service.errors import StoreError

ALLOWED = "only one SELECT or WITH … SELECT statement is allowed"
SIMPLIFY = "simplify it"  # how a refusal of a statement's size or depth ends

# table functions a SELECT may call on every backend: generators and the catalogue's own listing
# of the results' tables (which name no connection and no file)
TABLE_FUNCTIONS = frozenset(
    {
        "range",
        "generate_series",
        "unnest",
        "repeat",
        "json_each",
        "json_tree",
        "duckdb_tables",
        "duckdb_views",
        "duckdb_columns",
        "duckdb_schemas",
        "duckdb_types",
        "duckdb_functions",
        "duckdb_constraints",
        "duckdb_indexes",
        "duckdb_keywords",
        "pragma_table_info",
    }
)
# listings of every attached database: where a backend hides a catalogue (a lake's), they would
# list its tables too, so there they are refused (SHOW TABLES and DESCRIBE list the results alone)
LISTINGS = frozenset(
    {
        "duckdb_tables",
        "duckdb_views",
        "duckdb_columns",
        "duckdb_schemas",
        "duckdb_types",
        "duckdb_constraints",
        "duckdb_indexes",
    }
)
# the system views a SELECT may name where no catalogue is hidden: the listings above as views, and
# the information schema (the same listings); pg_catalog's and sqlite's compatibility views are not
# (pg_settings shows the settings, pg_database the databases)
INFORMATION_SCHEMA = "information_schema"
# table functions that take a table's or a catalogue's name as a string: the name is inspected
# like a table the statement names (the string must be a constant)
NAMES_AS_STRINGS = ("pragma_table_info", "ducklake_")
_SCALAR_PREFIXES = ("postgres_", "pg_")
_SCALARS_ALLOWED = frozenset({"pg_typeof"})
# scalar functions that take a setting's, a sequence's or a statement's name or text as a string
_SCALARS_REFUSED = frozenset(
    {"current_setting", "nextval", "currval", "json_serialize_sql", "json_deserialize_sql", "json_serialize_plan"}
)
_SYSTEM_SCHEMAS = frozenset({INFORMATION_SCHEMA, "pg_catalog"})
_WORD = re.compile(r"[A-Za-z_]+")
# what a table name may reach although no results table has it: these prefixes name DuckDB's and
# its extensions' table functions and system views (``pragma_database_list`` is ``PRAGMA
# database_list``; ``pg_settings`` a view of ``duckdb_settings()``)
_FUNCTION_PREFIXES = (
    "pragma_",
    "duckdb_",
    "postgres_",
    "ducklake_",
    "read_",
    "sqlite_",
    "iceberg_",
    "delta_",
    "pg_",
)
_system_names: tuple[frozenset[str], frozenset[str]] | None = None


def table_function_names() -> frozenset[str]:
    """Every table function DuckDB knows here, its shipped extensions' included (once per process)."""
    return _names()[0]


def system_view_names() -> frozenset[str]:
    """Every view of DuckDB's system catalogue (``duckdb_databases``, ``information_schema.tables``,
    ``pg_catalog.pg_settings`` …), by name alone (once per process)."""
    return _names()[1]


def _names() -> tuple[frozenset[str], frozenset[str]]:
    global _system_names
    if _system_names is None:
        from headatlas.service.storage.duckdb_settings import duckdb_config

        with duckdb.connect(config=duckdb_config(threads=1)) as connection:
            for extension in ("ducklake", "postgres_scanner"):
                try:
                    connection.execute(f"LOAD {extension}")
                except duckdb.Error:
                    pass  # not shipped here: its functions cannot be called either
            functions = connection.execute(
                "SELECT DISTINCT lower(function_name) FROM duckdb_functions() "
                "WHERE function_type IN ('table', 'table_macro', 'pragma')"
            ).fetchall()
            views = connection.execute(
                "SELECT DISTINCT lower(view_name) FROM duckdb_views() WHERE database_name = 'system'"
            ).fetchall()
        _system_names = (frozenset(n for (n,) in functions), frozenset(n for (n,) in views))
    return _system_names


def refuse_import(sql: str) -> None:
    """Raise StoreError when any statement of ``sql`` starts with IMPORT (before it is parsed)."""
    try:
        tokens = duckdb.tokenize(sql)
    except duckdb.Error:
        return  # the parser reports it
    starts = [0] + [i + 1 for i, (pos, kind) in enumerate(tokens) if sql[pos : pos + 1] == ";"]
    for index in starts:
        if index < len(tokens):
            match = _WORD.match(sql, tokens[index][0])
            if match and match.group(0).upper() == "IMPORT":
                raise StoreError(f"refused: {ALLOWED}; got IMPORT")


def refusal(
    statement: str,
    *,
    table_functions: Iterable[str] = (),
    hidden_catalogs: Iterable[str] = (),
    keyword: str = "SELECT",
) -> str | None:
    """Why the SELECT ``statement`` may not run in the sandbox, or None. ``table_functions``: a
    backend's own allowed readers; ``hidden_catalogs``: prefixes of database or schema names that
    are not results (a lake's catalogue), whose presence also refuses the listings of every
    database (``LISTINGS``, the information schema, SHOW ALL TABLES); ``keyword``: the statement's
    first word, for messages."""
    if "\x00" in statement:
        return f"{keyword} holds a NUL character"
    try:
        # a literal, not a bound parameter: binding a Python value imports numpy and pandas, whose
        # threads would keep this process from forking its query's process (confined.threads_now)
        literal = "'" + statement.replace("'", "''") + "'"
        tree = json.loads(parser().execute(f"SELECT json_serialize_sql({literal})").fetchone()[0])  # type: ignore[index]
    except RecursionError:
        return too_deep(keyword)
    except (duckdb.Error, TypeError, ValueError) as exc:
        if is_too_deep(exc):
            return too_deep(keyword)
        return f"{keyword} could not be inspected ({exc})"
    if tree.get("error"):
        return f"{keyword} is not a plain SELECT that can be inspected ({tree.get('error_message', 'unknown')})"
    policy = _Policy(
        allowed=TABLE_FUNCTIONS | {name.lower() for name in table_functions},
        hidden=tuple(prefix.lower() for prefix in hidden_catalogs),
    )
    for node in _nodes(tree):
        why = policy.refusal(node)
        if why:
            return why
    return None


def too_deep(keyword: str = "SELECT") -> str:
    """The refusal of a statement nested past what the inspection (or DuckDB's parser) walks: an
    expression of about 300 to 500 levels (``1+1+…+1``, ``abs(abs(…))``, ``[[…]]``, CASE in CASE)."""
    return (
        f"{keyword} is nested too deeply to inspect (an expression, list or CASE hundreds of levels deep): {SIMPLIFY}"
    )


def is_too_deep(error: BaseException) -> bool:
    """Whether DuckDB's parser refused ``error``'s statement for its depth (its expression depth
    limit, or its own stack: "memory exhausted at or near …")."""
    text = str(error)
    return "Max expression depth limit" in text or "memory exhausted at or near" in text


def warm() -> None:
    """Learn DuckDB's names (``_names``: its extensions loaded, about a second) and open the parser
    now, in a process that forks the processes that inspect statements (the clean helper)."""
    _names()
    parser()


_PARSER: duckdb.DuckDBPyConnection | None = None


def parser() -> duckdb.DuckDBPyConnection:
    """A connection for parsing alone, with no worker threads (a process that forks its queries'
    processes stays single-threaded: confined.threads_now)."""
    global _PARSER
    if _PARSER is None:
        _PARSER = duckdb.connect(config={"threads": 1})
    return _PARSER.cursor()


class _Policy:
    def __init__(self, *, allowed: frozenset[str], hidden: tuple[str, ...]) -> None:
        self.allowed = allowed
        self.hidden = hidden
        self.listings = LISTINGS if hidden else frozenset()  # refused here

    def refusal(self, node: dict) -> str | None:
        for key in ("catalog_name", "schema_name", "catalog", "schema"):
            value = node.get(key)
            if isinstance(value, str) and self._hidden(value):
                return f"{value} is the lake's catalogue, not its results"
        kind = node.get("type")
        if kind == "TABLE_FUNCTION":
            return self._table_function(node.get("function") or {})
        if kind == "BASE_TABLE":
            return self._table(node.get("catalog_name"), node.get("schema_name"), node.get("table_name"))
        if kind == "SHOW_REF" and node.get("table_name"):
            return self._show(str(node["table_name"]), node.get("catalog_name"), node.get("schema_name"))
        if node.get("class") == "FUNCTION" and "function_name" in node:
            name = str(node["function_name"]).lower()
            if name in _SCALARS_REFUSED:
                return f"function {name}() takes a name or SQL as a string: it reads past the results"
            if name.startswith(_SCALAR_PREFIXES) and name not in _SCALARS_ALLOWED:
                return f"function {name}() reaches past the results"
        return None

    def _hidden(self, name: str) -> bool:
        return bool(self.hidden) and name.strip('"').lower().startswith(self.hidden)

    def _table_function(self, function: dict) -> str | None:
        name = str(function.get("function_name", "")).lower()
        if name not in self.allowed:
            return (
                f"table function {name}() is not allowed in sql (it reads outside the results; docs/reliability.md "
                "lists those allowed)"
            )
        if name in self.listings:
            return f"{name}() lists the lake's catalogue too: SHOW TABLES and DESCRIBE <table> list the results"
        if name.startswith(NAMES_AS_STRINGS):
            return self._named_by_strings(name, function.get("children") or [])
        return None

    def _named_by_strings(self, name: str, arguments: list) -> str | None:
        """A table function that takes names as strings (``pragma_table_info(table)``,
        ``ducklake_table_changes(catalogue, schema, table, …)``): its first three arguments must be
        literals, and each string is inspected as a name the statement wrote (``pragma_table_info``'s
        as a table)."""
        positional = [a for a in arguments if isinstance(a, dict) and not a.get("alias")]
        for argument in positional[:3]:
            if argument.get("type") != "VALUE_CONSTANT":
                return f"{name}() takes names as strings: pass them as literal strings"
            value = (argument.get("value") or {}).get("value")
            if not isinstance(value, str):
                continue
            parts = qualified_name(value)
            if parts is None:
                return f"{name}('{value}') does not name a table"
            if name == "pragma_table_info":
                catalog, schema, table = ([None] * (3 - len(parts)) + parts)[-3:]
                why = self._table(catalog, schema, table)
            else:
                why = next((f"{p} is the lake's catalogue, not its results" for p in parts if self._hidden(p)), None)
            if why:
                return why
        return None

    def _table(self, catalog: object, schema: object, table: object) -> str | None:
        """A table named in the statement (``catalog.schema.table``, each optional): refused when
        it is (or may be resolved as) one of DuckDB's system views or table functions, whatever
        its qualifiers, quotes or case; no results table is named like one
        (tests/test_sandbox_escapes.py)."""
        catalog, schema, name = (str(part or "").strip('"').lower() for part in (catalog, schema, table))
        for part in (catalog, schema):
            if self._hidden(part):
                return f"{part} is the lake's catalogue, not its results"
        system = catalog == "system" or schema == "system" or schema in _SYSTEM_SCHEMAS or catalog in _SYSTEM_SCHEMAS
        named_like_system = name in system_view_names() or name in table_function_names()
        if not (system or named_like_system or name.startswith(_FUNCTION_PREFIXES)):
            return None
        if schema == INFORMATION_SCHEMA or catalog == INFORMATION_SCHEMA:
            if self.hidden:
                return f"information_schema.{name} lists the lake's catalogue too: SHOW TABLES and DESCRIBE <table> list the results"
            return None
        if name in self.allowed and name in LISTINGS and name not in self.listings:
            return None  # duckdb_tables named as a view, where nothing is hidden
        if name in self.listings:
            return f"{name} lists the lake's catalogue too: SHOW TABLES and DESCRIBE <table> list the results"
        return f"{name} names a DuckDB system view or table function that is not allowed in sql (it reads outside the results)"

    def _show(self, target: str, catalog: object, schema: object) -> str | None:
        name = target.strip('"').lower()
        where = {str(part or "").strip('"').lower() for part in (catalog, schema)}
        if where & (_SYSTEM_SCHEMAS | {"system"}):
            return "SHOW … FROM a system catalogue shows more than the results"
        if name == "tables":
            return None  # SHOW TABLES: the default database's, the results
        if name == "__show_tables_expanded":
            if self.hidden:
                return (
                    "SHOW ALL TABLES lists the lake's catalogue too: SHOW TABLES and DESCRIBE <table> list the results"
                )
            return None  # every database's tables, which are the results alone here
        if name == "databases":
            return "SHOW DATABASES shows the databases' connections, not the results"
        return f"SHOW {name.upper()} shows more than the results"


def qualified_name(text: str) -> list[str] | None:
    """``a.b.c`` as DuckDB splits a qualified name (``"a.b".c`` quoted; ``""`` a quote inside quotes),
    or None when it is not one (empty parts, more than three, an unclosed quote)."""
    parts, current, quoted, pos = [], [], False, 0
    while pos < len(text):
        char = text[pos]
        if quoted:
            if char == '"':
                if text[pos + 1 : pos + 2] == '"':
                    current.append('"')
                    pos += 1
                else:
                    quoted = False
            else:
                current.append(char)
        elif char == '"':
            quoted = True
        elif char == ".":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        pos += 1
    parts.append("".join(current))
    if quoted or len(parts) > 3 or any(not part.strip() for part in parts):
        return None
    return [part.strip() for part in parts]


def _nodes(tree: Any) -> Iterator[dict]:
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
