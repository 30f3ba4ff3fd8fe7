"""A training series read back (``query trend --series``, ``query phases``, ``plot trend``): every
head's metric against the training step, with its 95% interval, and the phase changes. Returns
(columns, rows); layers and heads are 0-based.

A **phase change** of a head and metric is the pair of consecutive checkpoints between which the
metric changes most, among the pairs whose intervals do not overlap (SPEC §5d: each checkpoint's
jackknife interval over its replicate groups). The probe's scores (SPEC §8) carry no interval (one
probe per run): for them every pair counts, and ``min_change`` sets how large a change must be.
Heads change **together** when their phase changes of one metric fall between the same two
checkpoints.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError
from headatlas.service.reports.columns import PROBE_COLUMNS, sortable, unknown_metric
from headatlas.service.reports.query_support import Rows, fetch_rows, replicate_scheme
from headatlas.service.storage.series_rows import steps

# what the known answer of the toy series reads (the previous-token head, then the induction head)
PHASE_METRICS = ("prev_token_score", "induction_score", "attn_to_prev", "attn_induction")
# the least change of a probe score that counts as a phase change (it has no interval): a
# twentieth of a query's attention, over four times the spread of a random model's scores
PROBE_MIN_CHANGE = 0.05


def _check(conn: Connection, series: str, metric: str, layer: int | None, head: int | None) -> None:
    if head is not None and layer is None:
        raise ParameterError(Param("head"), " needs ", Param("layer"), ": a head is named by its layer and its index")
    if metric not in sortable():
        raise unknown_metric("metric", metric, sortable())
    found = steps(conn, series)  # refuses an unknown series
    if not found or layer is None:
        return
    ids = ",".join(str(s.run_id) for s in found)
    n_layers, n_heads = conn.exec_driver_sql(
        f"SELECT min(n_layers), min(n_heads) FROM runs WHERE run_id IN ({ids})"
    ).one()
    if not 0 <= layer < n_layers:
        raise ParameterError(Param("layer", layer), f": the series' runs have layers 0..{n_layers - 1} (0-based)")
    if head is not None and not 0 <= head < n_heads:
        raise ParameterError(Param("head", head), f": the series' runs have heads 0..{n_heads - 1} (0-based)")


def trend(
    conn: Connection,
    series: str,
    *,
    metric: str,
    layer: int | None = None,
    head: int | None = None,
    ci: bool = False,
) -> Rows:
    """``metric`` of every head (of ``layer``; one ``head``) at every step of ``series``: columns
    step, run_id, layer, head, the metric (and with ``ci`` its ``_lo``, ``_hi`` and the
    ``interval_by`` of the run; None for the probe's scores, which have no interval)."""
    _check(conn, series, metric, layer, head)
    probe = metric in PROBE_COLUMNS
    sql = f"""
        SELECT step, run_id, layer, head, drop_rep, {metric} AS value FROM series_head_metrics_reps
        WHERE series = :series AND (CAST(:layer AS INTEGER) IS NULL OR layer = :layer)
          AND (CAST(:head AS INTEGER) IS NULL OR head = :head) AND (drop_rep = -1 OR (:ci AND NOT :probe))
        ORDER BY layer, head, step, drop_rep
    """
    _cols, found = fetch_rows(conn, sql, {"series": series, "layer": layer, "head": head, "ci": ci, "probe": probe})
    columns = ["step", "run_id", "layer", "head", metric]
    rows = [(r[0], r[1], r[2], r[3], r[5]) for r in found if r[4] == -1]
    if not ci:
        return columns, rows
    if probe:
        return [*columns, f"{metric}_lo", f"{metric}_hi", "interval_by"], [(*r, None, None, None) for r in rows]
    from headatlas.service.reports.intervals import add_intervals

    reps = [(r[1], r[2], r[3], r[4], r[5]) for r in found if r[4] >= 0]
    columns, rows = add_intervals(columns, rows, reps, keys=("run_id", "layer", "head"), metrics=[metric])
    schemes = {run_id: replicate_scheme(conn, run_id) for run_id in {r[1] for r in rows}}
    return [*columns, "interval_by"], [(*r, schemes[r[1]]) for r in rows]


@dataclass(frozen=True)
class Phase:
    """A head's largest change of one metric between consecutive checkpoints."""

    metric: str
    layer: int
    head: int
    step_before: int
    step_after: int
    before: float
    after: float
    beyond: bool | None  # the two intervals do not overlap; None: the metric has no interval


def phases(
    conn: Connection,
    series: str,
    *,
    metrics: tuple[str, ...] = PHASE_METRICS,
    layer: int | None = None,
    head: int | None = None,
    min_change: float | None = None,
) -> list[Phase]:
    """Each head's phase change of each metric (module docstring), by metric then layer and head;
    a head with no pair beyond its intervals (or no change of ``min_change`` or more; default 0,
    and ``PROBE_MIN_CHANGE`` for a probe score) has none."""
    found = []
    for metric in metrics:
        least = min_change if min_change is not None else PROBE_MIN_CHANGE if metric in PROBE_COLUMNS else 0.0
        columns, rows = trend(conn, series, metric=metric, layer=layer, head=head, ci=metric not in PROBE_COLUMNS)
        at = {c: i for i, c in enumerate(columns)}
        by_head: dict[tuple[int, int], list[tuple]] = defaultdict(list)
        for r in rows:
            by_head[(r[at["layer"]], r[at["head"]])].append(r)
        for (lay, hd), series_rows in sorted(by_head.items()):
            best = None
            for a, b in zip(series_rows, series_rows[1:], strict=False):
                va, vb = a[at[metric]], b[at[metric]]
                if va is None or vb is None or abs(vb - va) < least:
                    continue
                beyond = None
                if metric not in PROBE_COLUMNS:
                    lo_a, hi_a = a[at[f"{metric}_lo"]], a[at[f"{metric}_hi"]]
                    lo_b, hi_b = b[at[f"{metric}_lo"]], b[at[f"{metric}_hi"]]
                    if None in (lo_a, hi_a, lo_b, hi_b):
                        continue
                    beyond = lo_b > hi_a or hi_b < lo_a
                    if not beyond:
                        continue
                if best is None or abs(vb - va) > abs(best.after - best.before):
                    best = Phase(metric, lay, hd, a[at["step"]], b[at["step"]], va, vb, beyond)
            if best is not None:
                found.append(best)
    return found


def phase_rows(found: list[Phase]) -> Rows:
    """The phase changes as a table, each with the heads whose change of the same metric falls
    between the same two checkpoints (``together``: ``L1H3`` …, 0-based)."""
    groups: dict[tuple[str, int], list[Phase]] = defaultdict(list)
    for p in found:
        groups[(p.metric, p.step_after)].append(p)
    columns = [
        "metric",
        "layer",
        "head",
        "step_before",
        "step_after",
        "before",
        "after",
        "change",
        "beyond",
        "together",
    ]
    rows = []
    for p in found:
        others = [f"L{q.layer}H{q.head}" for q in groups[(p.metric, p.step_after)] if q is not p]
        rows.append(
            (
                p.metric,
                p.layer,
                p.head,
                p.step_before,
                p.step_after,
                p.before,
                p.after,
                p.after - p.before,
                p.beyond,
                " ".join(others),
            )
        )
    return columns, rows


def largest_phases(found: list[Phase]) -> dict[str, Phase]:
    """Per metric, the head whose phase change is the largest rise: where the toy's known answer
    reads the previous-token head and the induction head."""
    best: dict[str, Phase] = {}
    for p in found:
        if p.after > p.before and (
            p.metric not in best or p.after - p.before > best[p.metric].after - best[p.metric].before
        ):
            best[p.metric] = p
    return best
