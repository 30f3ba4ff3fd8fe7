"""A finished run's derived results, stored once and read while they are current.

Every metric, interval and role is derived from a run's additive sums when it is read (SPEC §5,
§7). For a finished run that costs seconds (the jackknife intervals of every head, the role tests
on the whole run and on each half), so when a run ends its results are computed once and stored
(``service/reports/stored.py``): ``run_results`` holds, per run and kind (``heads``: ``query
heads --ci``; ``roles``: ``query roles --stability``; ``layers``: ``query layers --ci``;
``head_reps``, ``layer_reps``: the rows of ``head_metrics_reps``, ``layer_metrics_reps``;
``distances``: each head's ``query distances --ci``; ``anchors:10``: each head's ten most
frequent anchors, as a head's page names them), the
columns and rows exactly as the library returns them (JSON: ints stay ints, floats round-trip
exactly); ``role_results`` holds the roles again as typed rows, for SQL (the ``roles`` view).

Each is keyed by two strings, and is read only while both are what they would be now:

- ``fingerprint``: the run's content (``fingerprint``): per table that holds rows of the run, their
  count and (but where rows are counted only) the sum of their hashes, the run's own row without
  its name (and without the per-window tables no result reads, ``NOT_READ``). A run resumed or extended, a batch retried, a probe or effects added, change it; a
  rename, a tag or another run's rows do not. Results are stored beside the rows they describe,
  so the result tables are left out of it.
- ``derivation``: the code that derives them (``derivation``): the sources of the modules that
  compute metrics, intervals and roles, the metric declarations (plugins' included) and DuckDB's
  version. Another version of headatlas reads nothing an older one stored.

Stale or missing results are never returned: the reader computes them as before
(``load`` returns None). ``headatlas db upgrade`` stores them again for every finished run.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.storage.db import has_table
from headatlas.service.storage.runs import now

RESULT_TABLES = ("run_results", "role_results")
KINDS = ("heads", "roles", "layers", "head_reps", "layer_reps", "distances", "anchors:10")
# a run's rows in these tables (per window or per token: millions on a large run) are counted; in the
# others they are also hashed, so that rows rewritten in place change the fingerprint too
COUNTED_ONLY = frozenset({"anchors", "anchor_tokens", "dist_hist", "run_windows", "csm_bins", "mixing_dist"})
# per-window rows that no stored result reads (no view reads them: tests/test_stored_results.py checks),
# left out of the results' fingerprint: a batch stored adds rows to the sums beside them, which are
# in it; counting them was most of a large run's fingerprint (2.9 M anchors of 20,000 windows)
NOT_READ = frozenset({"anchors", "run_windows"})
# a run's names and tags, and the pruning curves measured of it afterwards (`headatlas prune`): not
# what its results are derived from (a prune left the roles view empty until `db upgrade`). Its
# streaming effects (`effects RUN --streaming`) are: the head tables show them (SPEC §10)
NOT_RESULTS = frozenset(
    {
        "run_aliases",
        "run_tags",
        "prunes",
        "prune_curves",
        "streaming_curves",
        "streaming_curve_steps",
        "head_examples",  # the heads' top examples: no result reads them
        "example_windows",
    }
)
# the run's own row, hashed without these columns (a rename changes no result)
RUN_ROW_IGNORED = frozenset({"name"})

# role_results: the columns of ``role_tests.COLUMNS`` and ``roles.STABILITY_COLUMNS``, typed
ROLE_COLUMNS: tuple[tuple[str, str], ...] = (
    ("layer", "INTEGER"),
    ("head", "INTEGER"),
    ("role", "VARCHAR"),
    ("primary", "BOOLEAN"),
    ("metric", "VARCHAR"),
    ("value", "DOUBLE"),
    ("value_lo", "DOUBLE"),
    ("value_hi", "DOUBLE"),
    ("threshold", "DOUBLE"),
    ("test", "VARCHAR"),
    ("p", "DOUBLE"),
    ("p_holm", "DOUBLE"),
    ("family", "INTEGER"),
    ("probe_score", "DOUBLE"),
    ("probe_min", "DOUBLE"),
    ("rule", "VARCHAR"),
    ("half_a", "BOOLEAN"),
    ("half_b", "BOOLEAN"),
    ("stable", "BOOLEAN"),
)

# the modules whose code decides a stored number (relative to the package's service/ folder)
DERIVING_MODULES = (
    "metrics.py",
    "storage/views.py",
    "storage/run_results.py",
    "engine/results.py",
    "engine/schemes.py",
    "reports/queries.py",
    "reports/query_support.py",
    "reports/layer_queries.py",
    "reports/distance_queries.py",
    "reports/mixing_queries.py",
    "reports/trend_queries.py",
    "reports/roles.py",
    "reports/role_rules.py",
    "reports/role_tests.py",
    "reports/intervals.py",
    "reports/halves.py",
    "reports/significance.py",
    "reports/columns.py",
    "reports/attention_kind.py",
    "reports/tokens.py",
    "reports/stored.py",
)


def _stored_as(name: str) -> str:
    """A roles column's name in ``role_results`` (``primary``, a keyword, is ``is_primary`` there)."""
    return "is_primary" if name == "primary" else name


@cache
def derivation() -> str:
    """What the code that derives a run's results is: a digest of the deriving modules' sources,
    the declared view columns (plugins' included) and DuckDB's version."""
    import duckdb

    from headatlas.service.metrics import all_columns

    digest = hashlib.sha256()
    service = Path(__file__).resolve().parents[1]
    for name in DERIVING_MODULES:
        path = service / name
        digest.update(name.encode())
        digest.update(path.read_bytes() if path.is_file() else b"-")
    for c in all_columns():
        digest.update(repr((c.name, c.sql, c.interval, c.heads, c.layers, c.bounds)).encode())
    digest.update(duckdb.__version__.encode())
    return digest.hexdigest()[:32]


def tables_with_column(conn: Connection, column: str) -> list[str]:
    """The base tables of the main schema that have ``column``, by name."""
    # DuckDB's catalogue functions, not information_schema (views over them and the views'
    # catalogue): half the cost, and a page's first read asks this
    rows = conn.execute(
        text(
            "SELECT c.table_name FROM duckdb_columns() c JOIN duckdb_tables() t USING (table_oid) "
            "WHERE c.column_name = :column AND c.schema_name = 'main' ORDER BY c.table_name"
        ),
        {"column": column},
    )
    return [r[0] for r in rows]


def run_tables(conn: Connection) -> list[str]:
    """The base tables that hold rows of a run (a ``run_id`` column)."""
    return tables_with_column(conn, "run_id")


def _run_row_columns(conn: Connection) -> list[str]:
    # the table's own columns in their order (information_schema.columns costs ten times as much)
    rows = conn.execute(text("SELECT name FROM pragma_table_info('main.runs') ORDER BY cid"))
    return [r[0] for r in rows if r[0] not in RUN_ROW_IGNORED]


def fingerprint_sql(conn: Connection, *, one_run: bool) -> str:
    """SQL giving ``(run_id, fingerprint)`` per run (``one_run``: of ``:run`` alone; a run without
    rows gives none). The same text is built into the ``roles`` view, so Python and SQL agree."""
    return _fingerprint_sql(conn, " WHERE x.run_id = :run" if one_run else "")


def _fingerprint_sql(conn: Connection, where: str) -> str:
    parts = []
    for t in run_tables(conn):
        if t in NOT_RESULTS or t in RESULT_TABLES or t in NOT_READ:
            continue
        if t in COUNTED_ONLY:
            hashed = "NULL"
        elif t == "runs":
            hashed = f"sum(hash({', '.join(f'x.{c}' for c in _run_row_columns(conn))}))"
        else:
            hashed = "sum(hash(x))"
        parts.append(
            f"SELECT x.run_id, '{t}' AS t, count(*) AS n, {hashed} AS h FROM main.{t} x{where} GROUP BY x.run_id"
        )
    union = " UNION ALL ".join(parts)
    return (
        "SELECT run_id, md5(string_agg(t || ':' || CAST(n AS VARCHAR) || ':' || coalesce(CAST(h AS VARCHAR), '-'), "
        f"';' ORDER BY t)) AS fingerprint FROM ({union}) GROUP BY run_id"
    )


def fingerprint(conn: Connection, run_id: int) -> str | None:
    """The run's content fingerprint (None: nothing stored of it)."""
    row = conn.execute(text(fingerprint_sql(conn, one_run=True)), {"run": run_id}).first()
    return None if row is None else str(row[1])


# the fingerprints ``load`` found, per transaction (a connection is one transaction: the store opens
# a new one for each) and run: a page reads several kinds of one run in one read transaction
_FOUND: weakref.WeakKeyDictionary[Connection, dict[int, str | None]] = weakref.WeakKeyDictionary()
# the connections that found the result tables: a page's reads ask once, not once per kind (only a
# table found is remembered: an upgrade creates them within one connection, none drops them)
_HAS_TABLES: weakref.WeakSet[Connection] = weakref.WeakSet()


def read_fingerprint(conn: Connection, run_id: int) -> str | None:
    """``fingerprint``, computed once per transaction ``conn`` and run (what ``load`` compares)."""
    return read_fingerprints(conn, [run_id])[0]


def read_fingerprints(conn: Connection, run_ids: Sequence[int]) -> list[str | None]:
    """``read_fingerprint`` of each run, those not yet read in one query (the runs a comparison
    pairs: one catalogue read and one pass over each table, not one per run)."""
    seen = _FOUND.setdefault(conn, {})
    missing = sorted({r for r in run_ids if r not in seen})
    if len(missing) == 1:
        seen[missing[0]] = fingerprint(conn, missing[0])
    elif missing:
        named = {f"run{k}": r for k, r in enumerate(missing)}
        where = f" WHERE x.run_id IN ({', '.join(f':{n}' for n in named)})"
        found = {int(r[0]): str(r[1]) for r in conn.execute(text(_fingerprint_sql(conn, where)), named)}
        seen.update({r: found.get(r) for r in missing})
    return [seen[r] for r in run_ids]


def has_tables(conn: Connection) -> bool:
    """Whether the database has the result tables (a schema before them does not)."""
    if conn in _HAS_TABLES:
        return True
    found = has_table(conn, "run_results")
    if found:
        _HAS_TABLES.add(conn)
    return bool(found)


def stored_key(conn: Connection, run_id: int) -> tuple[str, str] | None:
    """(fingerprint, derivation) of the results stored for the run (None: none)."""
    if not has_tables(conn):
        return None
    row = conn.execute(
        text("SELECT fingerprint, derivation FROM run_results WHERE run_id = :run AND kind = 'roles'"), {"run": run_id}
    ).first()
    return None if row is None else (str(row[0]), str(row[1]))


def is_fresh(conn: Connection, run_id: int) -> bool:
    """Whether the run's stored results are current (its content and this code's derivation)."""
    key = stored_key(conn, run_id)
    return key is not None and key[1] == derivation() and key[0] == fingerprint(conn, run_id)


_BYPASS: ContextVar[bool] = ContextVar("headatlas_results_bypassed", default=False)


@contextmanager
def computed() -> Iterator[None]:
    """Within: ``load`` finds nothing, so the readers compute every result as if none were stored
    (deriving them, and the tests that compare the two)."""
    token = _BYPASS.set(True)
    try:
        yield
    finally:
        _BYPASS.reset(token)


def load(conn: Connection, run_id: int, kind: str) -> tuple[list[str], list[tuple]] | None:
    """The stored ``kind`` of the run as (columns, rows), or None where none is stored or it is
    stale (the caller computes it)."""
    if _BYPASS.get() or not has_tables(conn):
        return None
    row = conn.execute(
        text("SELECT fingerprint, derivation, columns, rows FROM run_results WHERE run_id = :run AND kind = :kind"),
        {"run": run_id, "kind": kind},
    ).first()
    if row is None or row[1] != derivation() or row[0] != read_fingerprint(conn, run_id):
        return None
    return list(json.loads(row[2])), [tuple(r) for r in json.loads(row[3])]


def save(conn: Connection, run_id: int, key: str, results: dict[str, tuple[list[str], list[tuple]]]) -> None:
    """Store ``results`` (kind → (columns, rows)) of the run under its fingerprint ``key`` and this
    code's derivation, in the caller's transaction, in place of what was stored before."""
    _FOUND.pop(conn, None)
    conn.execute(text("DELETE FROM run_results WHERE run_id = :run"), {"run": run_id})
    conn.execute(text("DELETE FROM role_results WHERE run_id = :run"), {"run": run_id})
    stamp, made_by = now(), derivation()
    for kind, (columns, rows) in results.items():
        conn.execute(
            text(
                "INSERT INTO run_results (run_id, kind, fingerprint, derivation, stored_at, columns, rows) "
                "VALUES (:run, :kind, :fp, :d, :ts, :columns, :rows)"
            ),
            {
                "run": run_id,
                "kind": kind,
                "fp": key,
                "d": made_by,
                "ts": stamp,
                "columns": json.dumps(list(columns)),
                "rows": json.dumps([list(r) for r in rows]),
            },
        )
    role_columns, role_rows = results["roles"]
    if role_rows:
        # one statement, each column a typed list unnested beside the others (executemany ran one
        # INSERT per row: most of storing a finished run's results)
        index = [role_columns.index(n) for n, _ in ROLE_COLUMNS]
        listed = ", ".join(_stored_as(n) for n, _ in ROLE_COLUMNS)
        unnested = ", ".join(f"unnest(CAST(:c{k} AS {kind}[]))" for k, (_, kind) in enumerate(ROLE_COLUMNS))
        values = {f"c{k}": [r[j] for r in role_rows] for k, j in enumerate(index)}
        conn.execute(
            text(
                f"INSERT INTO role_results (run_id, ordinal, {listed}) "
                f"SELECT :run, unnest(CAST(:ordinal AS INTEGER[])), {unnested}"
            ),
            {"run": run_id, "ordinal": list(range(len(role_rows))), **values},
        )


def views_sql(conn: Connection) -> list[str]:
    """The ``roles`` view: the stored roles of every run whose stored results are current (its
    fingerprint, computed here as ``fingerprint`` computes it, and this code's derivation)."""
    listed = ", ".join(f'r.{_stored_as(n)} AS "{n}"' for n, _ in ROLE_COLUMNS)
    return [
        f"""
        CREATE VIEW roles AS
        WITH current_runs AS ({fingerprint_sql(conn, one_run=False)}),
        fresh AS (
            SELECT k.run_id FROM run_results k JOIN current_runs c ON c.run_id = k.run_id
            WHERE k.kind = 'roles' AND k.fingerprint = c.fingerprint AND k.derivation = '{derivation()}'
        )
        SELECT r.run_id, {listed} FROM role_results r
        WHERE r.run_id IN (SELECT run_id FROM fresh)
        ORDER BY r.run_id, r.ordinal
        """
    ]


VIEWS = ("roles",)


def rebuild_views(conn: Connection) -> None:
    """Drop and create the results views (at the end of every upgrade that reaches the head)."""
    for name in VIEWS:
        conn.execute(text(f"DROP VIEW IF EXISTS {name}"))
    if has_tables(conn):
        for statement in views_sql(conn):
            conn.execute(text(statement))
