"""A metric across a schedule's runs, in fire order (``query trend``). Returns (columns, rows)."""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports.columns import HEAD_COLUMNS, sortable, unknown_metric
from headatlas.service.reports.query_support import Rows, fetch_rows, replicate_scheme

LAYER_METRICS = tuple(c for c in HEAD_COLUMNS[2:] if c not in ("high_pairs", "windows"))


def _check_schedule_shape(conn: Connection, schedule_id: int, layer: int, head: int | None) -> None:
    """``--layer``/``--head`` within every run of the schedule (a layer no run has would show as a
    trend of empty values)."""
    n_layers, n_heads = conn.execute(
        text(
            "SELECT min(n_layers), min(n_heads) FROM runs WHERE run_key IN "
            "(SELECT run_key FROM schedule_fires WHERE schedule_id = :s)"
        ),
        {"s": schedule_id},
    ).one()
    if n_layers is None:  # no run yet: nothing to check against, and an empty trend is the truth
        return
    if not 0 <= layer < n_layers:
        raise ParameterError(Param("layer", layer), f": the schedule's runs have layers 0..{n_layers - 1} (0-based)")
    if head is not None and not 0 <= head < n_heads:
        raise ParameterError(Param("head", head), f": the schedule's runs have heads 0..{n_heads - 1} (0-based)")


def trend(
    conn: Connection,
    schedule_id: int,
    *,
    metric: str,
    layer: int | None = None,
    head: int | None = None,
    ci: bool = False,
) -> Rows:
    """A metric across a schedule's runs, in fire order: one head (``layer`` and ``head``, from
    head_metrics), one layer (``layer``, from layer_metrics) or the mean over layers. A run
    shared by several fires (nothing changed between them) appears once, at its first fire."""
    if head is not None and layer is None:
        raise ParameterError(Param("head"), " needs ", Param("layer"), ": a head is named by its layer and its index")
    allowed = sortable() if head is not None else LAYER_METRICS
    if metric not in allowed:
        raise unknown_metric("metric", metric, allowed)
    if layer is not None:
        _check_schedule_shape(conn, schedule_id, layer, head)
    if head is not None:
        value = (
            f"SELECT run_id, drop_rep, {metric} AS value FROM head_metrics_reps WHERE layer = :layer AND head = :head"
        )
    elif layer is not None:
        value = f"SELECT run_id, drop_rep, {metric} AS value FROM layer_metrics_reps WHERE layer = :layer"
    else:
        value = f"SELECT run_id, drop_rep, avg({metric}) AS value FROM layer_metrics_reps GROUP BY run_id, drop_rep"
    sql = f"""
        WITH fired AS (
            SELECT run_key, min(fire_time) AS fire_time FROM schedule_fires
            WHERE schedule_id = :s AND run_key IS NOT NULL GROUP BY run_key
        ),
        mine AS (SELECT r.run_id, r.name, r.status, f.fire_time FROM fired f JOIN runs r USING (run_key)),
        v AS (SELECT * FROM ({value}) WHERE run_id IN (SELECT run_id FROM mine) AND (drop_rep = -1 OR :ci))
        SELECT mine.fire_time, mine.run_id, mine.name AS run, mine.status, v.drop_rep, v.value AS {metric}
        FROM mine LEFT JOIN v USING (run_id)
        ORDER BY mine.fire_time, v.drop_rep
    """
    columns, all_rows = fetch_rows(conn, sql, {"s": schedule_id, "layer": layer, "head": head, "ci": ci})
    keep = [c for c in columns if c != "drop_rep"]
    rows = [tuple(v for c, v in zip(columns, r) if c != "drop_rep") for r in all_rows if r[4] is None or r[4] == -1]
    if not ci:
        return keep, rows
    from headatlas.service.reports.intervals import add_intervals

    reps = [(r[1], r[4], r[5]) for r in all_rows if r[4] is not None and r[4] >= 0]
    columns, rows = add_intervals(keep, rows, reps, keys=("run_id",), metrics=[metric])
    # each fire's run says its own replicate scheme (SPEC §5d)
    run_idx = columns.index("run_id")
    return [*columns, "interval_by"], [(*r, replicate_scheme(conn, r[run_idx])) for r in rows]
