"""What user SQL may say before it reaches the sandbox: one SELECT, reading the results alone.

The engine's settings (``duckdb_settings.READONLY_CONFIG``: no external access, locked configuration)
stop a SELECT from reading files or changing settings, but not from running SQL that it carries
as a string: ``query('…')`` and ``query_table('…')`` run text the statement check never saw, and
on a lake the PostgreSQL extension (loaded for the catalogue) runs anything on the catalogue's
server (``postgres_query``). So the whole parse tree is inspected, every node of every subquery:

- **table functions** (called with parentheses, or named bare as a table: ``FROM duckdb_databases``
  calls the function) must be on an allow-list (``TABLE_FUNCTIONS``, plus a backend's own readers,
  ``Backend.sandbox_table_functions``): ``query``, ``query_table``, ``postgres_query``,
  ``postgres_scan``, ``json_execute_serialized_sql``, ``duckdb_databases`` (which shows a
  catalogue's connection string), the file readers and every function added later are refused;
- **scalar functions** named ``postgres_*`` / ``pg_*`` (but ``pg_typeof``) are refused;
- **tables** of a hidden catalogue (a lake's ``__ducklake_metadata_*``) are refused, however quoted;
- ``SHOW DATABASES`` is refused (connection strings), and a statement that cannot be serialised
  for inspection is refused rather than run unseen.

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
_SCALAR_PREFIXES = ("postgres_", "pg_")
_SCALARS_ALLOWED = frozenset({"pg_typeof"})
_SHOW_REFUSED = frozenset({"databases"})
_WORD = re.compile(r"[A-Za-z_]+")
# what a bare table name may call although no table has it: these prefixes name DuckDB's and its
# extensions' table functions (``pragma_database_list`` is ``PRAGMA database_list``)
_FUNCTION_PREFIXES = ("pragma_", "duckdb_", "postgres_", "ducklake_", "read_", "sqlite_", "iceberg_", "delta_")
_table_functions: frozenset[str] | None = None


def table_function_names() -> frozenset[str]:
    """Every table function DuckDB knows here, its shipped extensions' included (once per process)."""
    global _table_functions
    if _table_functions is None:
        from headatlas.service.storage.duckdb_settings import duckdb_config

        with duckdb.connect(config=duckdb_config()) as connection:
            for extension in ("ducklake", "postgres_scanner"):
                try:
                    connection.execute(f"LOAD {extension}")
                except duckdb.Error:
                    pass  # not shipped here: its functions cannot be called either
            rows = connection.execute(
                "SELECT DISTINCT lower(function_name) FROM duckdb_functions() "
                "WHERE function_type IN ('table', 'table_macro', 'pragma')"
            ).fetchall()
        _table_functions = frozenset(name for (name,) in rows)
    return _table_functions


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
    are not results (a lake's catalogue); ``keyword``: the statement's first word, for messages."""
    try:
        tree = json.loads(duckdb.execute("SELECT json_serialize_sql(?)", [statement]).fetchone()[0])  # type: ignore[index]
    except (duckdb.Error, TypeError, ValueError) as exc:
        return f"{keyword} could not be inspected ({exc})"
    if tree.get("error"):
        return f"{keyword} is not a plain SELECT that can be inspected ({tree.get('error_message', 'unknown')})"
    allowed = TABLE_FUNCTIONS | {name.lower() for name in table_functions}
    hidden = tuple(prefix.lower() for prefix in hidden_catalogs)
    for node in _nodes(tree):
        kind = node.get("type")
        if kind == "TABLE_FUNCTION":
            name = str((node.get("function") or {}).get("function_name", "")).lower()
            if name not in allowed:
                return f"table function {name}() is not allowed in sql (it reads outside the results; docs/reliability.md lists those allowed)"
        elif kind == "BASE_TABLE" and not node.get("catalog_name") and not node.get("schema_name"):
            name = str(node.get("table_name", "")).lower()
            if name not in allowed and (name in table_function_names() or name.startswith(_FUNCTION_PREFIXES)):
                return f"{name} names a table function that is not allowed in sql (it reads outside the results)"
        elif "function_name" in node and node.get("class") == "FUNCTION":
            name = str(node["function_name"]).lower()
            if name.startswith(_SCALAR_PREFIXES) and name not in _SCALARS_ALLOWED:
                return f"function {name}() reaches past the results"
        if kind == "SHOW_REF" and str(node.get("table_name", "")).strip('"').lower() in _SHOW_REFUSED:
            return "SHOW DATABASES shows the databases' connections, not the results"
        for key in ("catalog_name", "schema_name"):
            value = node.get(key)
            if hidden and isinstance(value, str) and value.lower().startswith(hidden):
                return f"{value} is the lake's catalogue, not its results"
    return None


def _nodes(tree: Any) -> Iterator[dict]:
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
