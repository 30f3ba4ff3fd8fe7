"""Training series (migration 0022): one model's checkpoints, each analysed as a run and tagged
with its training step. Every function works in the caller's transaction.

A lake has no keys: a step stored again is deleted and inserted (one checkpoint per step), and a
series' id is the largest one plus one rather than a sequence's.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, RunNotFound
from headatlas.service.storage import db


@dataclass(frozen=True)
class SeriesStep:
    """One checkpoint of a series: its training step, where it was read from, and its run."""

    step: int
    checkpoint: str
    run_id: int
    run: str  # the run's name
    status: str


def series_views() -> list[str]:
    """``CREATE VIEW`` statements of ``series_head_metrics_reps`` (every head's metrics and probe
    scores against the steps of each series, with the jackknife's rows, ``drop_rep``) and
    ``series_head_metrics`` (its ``drop_rep = -1`` rows): derived views (``views.py``), made again
    whenever ``head_metrics_reps`` is, since DuckDB fixes a view's column types when it is made."""
    return [
        """
        CREATE VIEW series_head_metrics_reps AS
        SELECT s.name AS series, r.step, r.checkpoint, h.*,
               p.induction_score, p.duplicate_score, p.prev_token_score
        FROM training_series s JOIN series_runs r USING (series_id)
        JOIN head_metrics_reps h ON h.run_id = r.run_id
        LEFT JOIN probe_scores p ON p.run_id = h.run_id AND p.layer = h.layer AND p.head = h.head
        """,
        "CREATE VIEW series_head_metrics AS SELECT * EXCLUDE (drop_rep) FROM series_head_metrics_reps "
        "WHERE drop_rep = -1",
    ]


def series_id(conn: Connection, name: str) -> int | None:
    row = conn.execute(text("SELECT series_id FROM training_series WHERE name = :n"), {"n": name}).first()
    return None if row is None else int(row[0])


def ensure_series(conn: Connection, name: str, checkpoints: str) -> int:
    """The series named ``name`` (made from the ``checkpoints`` value when it is new)."""
    found = series_id(conn, name)
    if found is not None:
        return found
    if db.has_keys(conn):
        conn.execute(
            text("INSERT INTO training_series (name, checkpoints) VALUES (:n, :c)"), {"n": name, "c": checkpoints}
        )
    else:
        conn.execute(
            text(
                "INSERT INTO training_series (series_id, name, checkpoints, created_at) "
                "SELECT coalesce(max(series_id), 0) + 1, :n, :c, current_timestamp FROM training_series"
            ),
            {"n": name, "c": checkpoints},
        )
    found = series_id(conn, name)
    assert found is not None  # just inserted, in this transaction
    return found


def add_step(conn: Connection, series: int, step: int, checkpoint: str, run_id: int) -> None:
    """Record that ``run_id`` analysed the checkpoint of ``step`` (replacing what the step held)."""
    conn.execute(text("DELETE FROM series_runs WHERE series_id = :s AND step = :t"), {"s": series, "t": step})
    conn.execute(
        text("INSERT INTO series_runs (series_id, step, checkpoint, run_id) VALUES (:s, :t, :c, :r)"),
        {"s": series, "t": step, "c": checkpoint, "r": run_id},
    )


def steps(conn: Connection, name: str) -> list[SeriesStep]:
    """The series' checkpoints in step order (refused, naming the series there are, when there is
    no series of that name). A run deleted since (`runs delete`) leaves its step out."""
    found = series_id(conn, name)
    if found is None:
        there = [r[0] for r in conn.execute(text("SELECT name FROM training_series ORDER BY name"))]
        known = f"; the series are {', '.join(map(repr, there))}" if there else ""
        raise RunNotFound(
            Param("series", name, quoted=True),
            f": no such training series{known}",
            hint="analyse one with `headatlas analyze CORPUS --checkpoints DIR --name NAME`",
        )
    rows = conn.execute(
        text(
            "SELECT s.step, s.checkpoint, s.run_id, r.name, r.status FROM series_runs s "
            "JOIN runs r USING (run_id) WHERE s.series_id = :s ORDER BY s.step"
        ),
        {"s": found},
    )
    return [SeriesStep(int(a), str(b), int(c), str(d), str(e)) for a, b, c, d, e in rows]


def list_series(conn: Connection) -> list[tuple[str, str, int]]:
    """(name, checkpoints value, steps stored) of every series, by name."""
    rows = conn.execute(
        text(
            "SELECT t.name, t.checkpoints, count(s.step) FROM training_series t "
            "LEFT JOIN series_runs s USING (series_id) GROUP BY t.name, t.checkpoints ORDER BY t.name"
        )
    )
    return [(str(a), str(b), int(c)) for a, b, c in rows]
