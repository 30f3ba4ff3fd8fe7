"""The causal effects of a run's heads (SPEC §9) as a table: ``run.effects()``, the report."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError, Phrase
from headatlas.service.metrics import EFFECT_COLUMNS
from headatlas.service.reports import query_support

HEAD_EFFECTS = [c for c in EFFECT_COLUMNS if c != "objective"]


def effects(conn: Connection, run_id: int, *, ci: bool = False, sort: str | None = None) -> query_support.Rows:
    """Per head, the effects the run stores (columns of kinds it did not measure left out), with
    95% intervals when ``ci``; sorted by ``sort`` (largest first) or by layer and head."""
    stored = [
        c
        for c in HEAD_EFFECTS
        if conn.execute(text(f"SELECT count({c}) FROM head_metrics WHERE run_id = :r"), {"r": run_id}).scalar()
    ]
    if not stored:
        raise ParameterError(
            f"run {run_id} has no causal effects: analyse with ",
            Param("effects", "zero,mean"),
            " (and gradient for a loss), or measure them without storing with ",
            Phrase("`headatlas effects CORPUS`", "`headatlas.effects(corpus)`"),
        )
    if sort is not None and sort not in stored:
        raise ParameterError(Param("sort", sort, quoted=True), f": run {run_id} stores {', '.join(stored)}")
    order = f"{sort} DESC NULLS LAST, layer, head" if sort else "layer, head"
    columns = ["layer", "head", *stored]
    rows = query_support.fetch_rows(
        conn, f"SELECT {', '.join(columns)} FROM head_metrics WHERE run_id = :run ORDER BY {order}", {"run": run_id}
    )
    if ci:
        rows = query_support.with_intervals(conn, rows, view="head_metrics_reps", keys=("layer", "head"), run_id=run_id)
    return rows
