"""Names, aliases and tags of runs; renaming and deleting runs (migration 0011).

A run has one name (``runs.name``) and any number of aliases (``run_aliases``); both resolve it
(``--run NAME``), so together they are unique across runs. Tags (``run_tags``) group runs and
never resolve one. Every function works in the caller's transaction.
"""

from __future__ import annotations

import unicodedata

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError, Part, StoreError
from headatlas.service.statuses import UNFINISHED  # noqa: F401 - where the commands have read it

BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)}


def _named(what: str | None, label: str) -> Part:
    """How a label is named in a message: the ``name`` parameter with its value, or ``what``
    (``NEW_NAME``, ``tag``) and the value."""
    return Param("name", label, quoted=True) if what is None else f"{what} {label!r}"


def check_label(label: str, *, what: str | None = None) -> str:
    """A run name, alias or tag is printable text, with no invisible formatting character; a name
    or alias cannot be read as a run id. ``what``: how the value is named in the message
    (``NEW_NAME``, ``tag``; None: the ``name`` parameter)."""
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in label):
        raise ParameterError(
            _named(what, label), ": holds a control character (newline, tab, terminal escape …); use printable text"
        )
    # bidi overrides and isolates (U+202A..U+202E, U+2066..U+2069) reorder what a terminal shows, and
    # zero-width characters (U+200B..U+200D, U+2060, U+FEFF) hide in it: either would let a name
    # display as another's. Unicode's format characters (category Cf) are all of these and their kin.
    hidden = next((c for c in label if unicodedata.category(c) == "Cf"), None)
    if hidden is not None:
        kind = "reorders the text shown" if hidden in BIDI else "is invisible"
        raise ParameterError(
            _named(what, label),
            f": holds U+{ord(hidden):04X} ({unicodedata.name(hidden, 'a format character')}), which {kind}; remove it",
        )
    if not label.strip():
        raise ParameterError(Param("name") if what is None else what, " is empty: pass some text")
    if label != label.strip():
        raise ParameterError(_named(what, label), f": starts or ends with a space; pass {label.strip()!r}")
    return label


def check_name(name: str, *, what: str | None = None) -> str:
    """A name or alias: a label that is not a run id (digits)."""
    check_label(name, what=what)
    if name.isdigit():
        named = Param("name", name) if what is None else f"{what} {name}"
        raise ParameterError(named, f": a number would be read as a run id; pass e.g. run-{name}")
    return name


def owner_of(conn: Connection, name: str) -> int | None:
    """The run that ``name`` names (its name or an alias), or None."""
    row = conn.execute(
        text("SELECT run_id FROM runs WHERE name = :n UNION ALL SELECT run_id FROM run_aliases WHERE alias = :n"),
        {"n": name},
    ).first()
    return None if row is None else int(row[0])


def run_by_alias(conn: Connection, alias: str) -> int | None:
    row = conn.execute(text("SELECT run_id FROM run_aliases WHERE alias = :a"), {"a": alias}).first()
    return None if row is None else int(row[0])


def add_alias(conn: Connection, run_id: int, alias: str) -> bool:
    """Let ``alias`` name the run too. False when it already names this run; a name of another
    run is refused."""
    check_name(alias)
    owner = owner_of(conn, alias)
    if owner == run_id:
        return False
    if owner is not None:
        raise StoreError(f"run name {alias!r} is taken by run {owner}: pass another name")
    conn.execute(text("INSERT INTO run_aliases (alias, run_id) VALUES (:a, :r)"), {"a": alias, "r": run_id})
    return True


def rename(conn: Connection, run_id: int, new: str) -> str:
    """Give the run the name ``new`` (an alias of the run becomes its name); returns the old name."""
    check_name(new, what="NEW_NAME")
    old = conn.execute(text("SELECT name FROM runs WHERE run_id = :r"), {"r": run_id}).scalar_one()
    owner = owner_of(conn, new)
    if owner is not None and owner != run_id:
        raise StoreError(f"NEW_NAME {new!r} is taken by run {owner}: pass another name, or rename that run first")
    conn.execute(text("DELETE FROM run_aliases WHERE alias = :a"), {"a": new})
    conn.execute(text("UPDATE runs SET name = :n WHERE run_id = :r"), {"n": new, "r": run_id})
    return old


def tag(conn: Connection, run_id: int, tags: list[str]) -> list[str]:
    """Add tags; returns those newly added."""
    added = []
    for label in tags:
        check_label(label, what="tag")
        exists = conn.execute(
            text("SELECT count(*) FROM run_tags WHERE run_id = :r AND tag = :t"), {"r": run_id, "t": label}
        ).scalar()
        if not exists:
            conn.execute(text("INSERT INTO run_tags (run_id, tag) VALUES (:r, :t)"), {"r": run_id, "t": label})
            added.append(label)
    return added


def untag(conn: Connection, run_id: int, tags: list[str]) -> list[str]:
    """Remove tags; returns those the run had."""
    removed = []
    for label in tags:
        gone = conn.execute(
            text("DELETE FROM run_tags WHERE run_id = :r AND tag = :t RETURNING tag"), {"r": run_id, "t": label}
        ).all()
        removed += [r[0] for r in gone]
    return removed


def labels(conn: Connection) -> dict[int, tuple[list[str], list[str]]]:
    """Per run id: (aliases, tags), each sorted."""
    out: dict[int, tuple[list[str], list[str]]] = {}
    for run_id, alias in conn.execute(text("SELECT run_id, alias FROM run_aliases ORDER BY alias")):
        out.setdefault(int(run_id), ([], []))[0].append(alias)
    for run_id, label in conn.execute(text("SELECT run_id, tag FROM run_tags ORDER BY tag")):
        out.setdefault(int(run_id), ([], []))[1].append(label)
    return out


def run_tables(conn: Connection) -> list[str]:
    """The base tables that hold rows per run (a ``run_id`` column), ``runs`` last."""
    names = [
        r[0]
        for r in conn.execute(
            text(
                "SELECT c.table_name FROM duckdb_columns() c JOIN duckdb_tables() t "
                "ON t.database_name = c.database_name AND t.schema_name = c.schema_name AND t.table_name = c.table_name "
                "WHERE c.column_name = 'run_id' AND c.database_name = current_database() AND c.schema_name = 'main' "
                "ORDER BY c.table_name"
            )
        )
    ]
    return [n for n in names if n != "runs"] + ["runs"]


def delete(conn: Connection, run_id: int) -> dict[str, int]:
    """Delete the run and every row of it: its sums, windows' records, probe, plan, aliases and
    tags; then the windows and documents no other run counted. Returns rows deleted per table."""
    counts = {}
    for table in run_tables(conn):
        n = _deleted(conn.execute(text(f'DELETE FROM "{table}" WHERE run_id = :r'), {"r": run_id}))
        if n:
            counts[table] = n
    # documents and windows are shared by content: keep those another run counted
    for table, sql in (
        ("windows", "DELETE FROM windows WHERE window_id NOT IN (SELECT window_id FROM run_windows)"),
        ("documents", "DELETE FROM documents WHERE doc_id NOT IN (SELECT doc_id FROM windows)"),
    ):
        n = _deleted(conn.execute(text(sql)))
        if n:
            counts[table] = n
    return counts


def _deleted(result) -> int:
    """Rows a DELETE removed: DuckDB answers with one row holding the count (rowcount is -1)."""
    row = result.first()
    return int(row[0]) if row is not None else 0
