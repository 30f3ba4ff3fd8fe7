"""The causal effects of a run's heads (SPEC §9) as a table: ``run.effects()``, ``headatlas effects
RUN``, the report.

Beside each stored effect, what a reader of Michel et al. 2019 ("Are Sixteen Heads Really Better
than One?") asks of it, computed here from the stored per-head means (nothing more is stored):

- ``<effect>_layer``: the effect normalised within its layer by the ℓ2 norm of the layer's
  effects, ``v_h / ‖v_layer‖₂`` (Michel et al.'s normalisation of importance scores), with its
  interval: the same normalisation of each leave-one-group-out value, then the jackknife.
- the head's primary ``role`` (SPEC §7), its ``noise_share`` (§5) and, where the run has a probe,
  the probe's scores (§8p), so that what a head does and what removing it costs are read together;
- ``significance_note``: how many heads' intervals lie above 0 (and below), per effect kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.errors import Param, ParameterError, Phrase
from headatlas.service.metrics import EFFECT_COLUMNS
from headatlas.service.reports import query_support
from headatlas.service.reports.columns import PROBE_COLUMNS

HEAD_EFFECTS = [c for c in EFFECT_COLUMNS if c != "objective"]
# the effects normalised within their layer (Michel et al. 2019: I_h / ‖I_layer‖₂); drifts are not
LAYER_NORMALISED = ("effect_zero", "effect_mean", "importance")
# what a head does, beside what removing it costs: the primary role, noise_share, the probe's scores
JOINED = ("role", "noise_share", *PROBE_COLUMNS)
# objectives whose every effect is ≥ 0 by construction (1 − cos ≥ 0 for any change)
DRIFT_OBJECTIVES = ("embedding_drift",)


def layer_name(column: str) -> str:
    """``importance`` → ``importance_layer``: the column of its per-layer normalisation."""
    return f"{column}_layer"


def layer_normalised(values: dict[tuple[int, int], float | None]) -> dict[tuple[int, int], float | None]:
    """``{(layer, head): v}`` → ``v / ‖v of the layer's heads‖₂`` (Michel et al. 2019); None where
    the head's value or any of its layer's is missing, or the layer's norm is 0."""
    by_layer: dict[int, list[float | None]] = {}
    for (layer, _head), v in values.items():
        by_layer.setdefault(layer, []).append(v)
    norms: dict[int, float | None] = {}
    for layer, vs in by_layer.items():
        known = [v for v in vs if v is not None and math.isfinite(v)]
        norm = math.sqrt(sum(v * v for v in known)) if len(known) == len(vs) else 0.0
        norms[layer] = norm if norm > 0 else None
    out: dict[tuple[int, int], float | None] = {}
    for (layer, head), v in values.items():
        of_layer = norms[layer]
        out[(layer, head)] = None if v is None or of_layer is None else v / of_layer
    return out


def stored_effects(conn: Connection, run_id: int) -> list[str]:
    """The effect columns the run holds a value of."""
    held = held_values(conn, run_id, HEAD_EFFECTS)
    return [c for c in HEAD_EFFECTS if held[c]]


def held_values(conn: Connection, run_id: int, columns: Sequence[str]) -> dict[str, int]:
    """``{column: its values in head_metrics for the run}`` (non-NULL): counted in a finished run's
    stored heads while they are current, else in one statement (each plans the view chain under
    head_metrics again, 40-100 ms of CPU; a read of a run's effects or roles asks two to four times)."""
    if not columns:
        return {}
    from headatlas.service.storage import run_results as stored

    kept = stored.load(conn, run_id, "heads")  # a finished run's stored heads hold every head column
    if kept is not None and all(c in kept[0] for c in columns):
        names, rows = kept
        at = {c: names.index(c) for c in columns}
        return {c: sum(r[i] is not None for r in rows) for c, i in at.items()}
    counts = ", ".join(f"count({c})" for c in columns)
    row = conn.execute(text(f"SELECT {counts} FROM head_metrics WHERE run_id = :r"), {"r": run_id}).one()
    return {c: int(n or 0) for c, n in zip(columns, row)}


def effects(
    conn: Connection, run_id: int, *, ci: bool = False, sort: str | None = None, joined: bool = True
) -> query_support.Rows:
    """Per head, the effects the run stores (columns of kinds it did not measure left out), each
    of ``LAYER_NORMALISED`` followed by its per-layer normalisation (``<effect>_layer``), with 95%
    intervals when ``ci``; ``joined``: then the head's primary ``role``, ``noise_share`` and the
    probe's scores (where the run has a probe). Sorted by ``sort`` (largest first) or by layer and
    head."""
    stored = stored_effects(conn, run_id)
    if not stored:
        raise ParameterError(
            f"run {run_id} has no causal effects: analyse with ",
            Param("effects", "zero,mean"),
            " (and gradient for a loss), or measure them without storing with ",
            Phrase("`headatlas effects CORPUS`", "`headatlas.effects(corpus)`"),
        )
    normalised = [c for c in LAYER_NORMALISED if c in stored]
    sortable = [*stored, *(layer_name(c) for c in normalised), *(("noise_share", *PROBE_COLUMNS) if joined else ())]
    if sort is not None and sort not in sortable:
        raise ParameterError(Param("sort", sort, quoted=True), f": run {run_id} stores {', '.join(sortable)}")
    base = ["layer", "head", *stored, *(["noise_share"] if joined else [])]
    rows = query_support.fetch_rows(
        conn, f"SELECT {', '.join(base)} FROM head_metrics WHERE run_id = :run ORDER BY layer, head", {"run": run_id}
    )
    if ci:
        rows = query_support.with_intervals(conn, rows, view="head_metrics_reps", keys=("layer", "head"), run_id=run_id)
    columns, values = _with_layer_norms(conn, run_id, rows, normalised, ci=ci)
    if joined:
        columns, values = _with_what_heads_do(conn, run_id, columns, values)
    if sort is not None:
        at = columns.index(sort)
        values = sorted(values, key=lambda r: (r[at] is None, -(r[at] or 0.0), r[0], r[1]))
    return columns, values


def _with_layer_norms(
    conn: Connection, run_id: int, rows: query_support.Rows, normalised: Sequence[str], *, ci: bool
) -> query_support.Rows:
    """``rows`` with ``<effect>_layer`` after each of ``normalised`` (and its interval's bounds:
    the normalisation of every leave-one-group-out value, the jackknife over the groups that hold
    the effect windows)."""
    columns, values = rows
    if not normalised:
        return rows
    li, hi = columns.index("layer"), columns.index("head")
    whole = {c: layer_normalised({(r[li], r[hi]): r[columns.index(c)] for r in values}) for c in normalised}
    intervals: dict[str, dict[tuple[int, int], tuple[float | None, float | None]]] = {}
    if ci:
        intervals = _layer_norm_intervals(conn, run_id, normalised, whole)
    out_columns: list[str] = []
    inserted: dict[int, str] = {}  # the index after which each normalisation goes
    for c in normalised:
        at = columns.index(f"{c}_hi") if ci and f"{c}_hi" in columns else columns.index(c)
        inserted[at] = c
    for i, name in enumerate(columns):
        out_columns.append(name)
        if i in inserted:
            out_columns += [layer_name(inserted[i])] + (
                [f"{layer_name(inserted[i])}_lo", f"{layer_name(inserted[i])}_hi"] if ci else []
            )
    out_rows = []
    for r in values:
        cells: list = []
        key = (r[li], r[hi])
        for i, cell in enumerate(r):
            cells.append(cell)
            if i in inserted:
                c = inserted[i]
                cells.append(whole[c][key])
                if ci:
                    cells += list(intervals.get(c, {}).get(key, (None, None)))
        out_rows.append(tuple(cells))
    return out_columns, out_rows


def _layer_norm_intervals(
    conn: Connection, run_id: int, normalised: Sequence[str], whole: dict[str, dict]
) -> dict[str, dict[tuple[int, int], tuple[float | None, float | None]]]:
    """Each normalised effect's 95% interval: §5d's jackknife over the leave-one-group-out
    normalisations (the groups that hold the effect windows), clipped to what it can take
    (``[0, 1]`` for importance, ``[−1, 1]`` for an effect)."""
    from headatlas.service.reports.intervals import jackknife_halfwidth
    from headatlas.service.storage.effect_rows import effect_groups

    groups = effect_groups(conn, run_id)
    found = conn.execute(
        text(
            f"SELECT drop_rep, layer, head, {', '.join(normalised)} FROM head_metrics_reps "
            "WHERE run_id = :r AND drop_rep >= 0"
        ),
        {"r": run_id},
    ).all()
    by_drop: dict[int, list[tuple]] = {}
    for row in found:
        if int(row[0]) in groups:
            by_drop.setdefault(int(row[0]), []).append(row)
    out: dict[str, dict[tuple[int, int], tuple[float | None, float | None]]] = {}
    for n, c in enumerate(normalised):
        drops = [layer_normalised({(int(r[1]), int(r[2])): r[3 + n] for r in rows}) for rows in by_drop.values()]
        low = 0.0 if c == "importance" else -1.0
        out[c] = {}
        for key, value in whole[c].items():
            half = None if value is None else jackknife_halfwidth([d.get(key) for d in drops])
            out[c][key] = (None, None) if half is None else (max(low, value - half), min(1.0, value + half))
    return out


def _with_what_heads_do(conn: Connection, run_id: int, columns: list[str], rows: list[tuple]) -> query_support.Rows:
    """``rows`` with each head's primary ``role`` (after ``head``'s effects, before ``noise_share``)
    and the probe's scores at the end where the run has a probe."""
    from headatlas.service.reports import roles
    from headatlas.service.reports.role_views import primary_grid

    li, hi = columns.index("layer"), columns.index("head")
    role_columns, role_rows = roles.roles(conn, run_id)
    n_layers = 1 + max((r[li] for r in rows), default=-1)
    n_heads = 1 + max((r[hi] for r in rows), default=-1)
    grid = primary_grid(role_columns, role_rows, n_layers, n_heads)
    probe = {
        (int(r[0]), int(r[1])): tuple(r[2:])
        for r in conn.execute(
            text(f"SELECT layer, head, {', '.join(PROBE_COLUMNS)} FROM probe_scores WHERE run_id = :r"), {"r": run_id}
        )
    }
    at = columns.index("noise_share")
    last = [c for c in columns if c == "interval_by"]  # the intervals' scheme stays the last column
    kept = [i for i, c in enumerate(columns) if c != "interval_by"]
    names = [columns[i] for i in kept]
    out_columns = [*names[:at], "role", *names[at:], *(PROBE_COLUMNS if probe else ()), *last]
    out_rows = []
    for r in rows:
        layer, head = r[li], r[hi]
        cells = [r[i] for i in kept]
        scores = probe.get((layer, head), (None,) * len(PROBE_COLUMNS)) if probe else ()
        scheme = (r[columns.index("interval_by")],) if last else ()
        out_rows.append((*cells[:at], grid[layer][head], *cells[at:], *scores, *scheme))
    return out_columns, out_rows


def significance_note(conn: Connection, run_id: int, read: query_support.Rows | None = None) -> str | None:
    """How many heads individually matter, per effect kind the run stores: "effect_mean: 31 of 72
    heads above 0 with 95% confidence (lower bound > 0), 2 below 0 (upper bound < 0)"; where every
    value is ≥ 0 by construction (a drift objective's effects; gradient importance, an absolute
    value), that "above 0" means measurably above, not a finding. None for a run without effects;
    said so where the intervals cannot be formed (effect windows in fewer than 2 groups). ``read``:
    the run's ``effects(..., ci=True)`` where the caller has read them (not read again)."""
    from headatlas.service.storage.effect_rows import run_effects

    recorded = run_effects(conn, run_id)
    stored = [c for c in stored_effects(conn, run_id) if c in LAYER_NORMALISED]
    if not recorded or not stored:
        return None
    columns, rows = read if read is not None else effects(conn, run_id, ci=True, joined=False)
    drift = recorded[0]["objective"] in DRIFT_OBJECTIVES
    parts = []
    for c in stored:
        v, lo, hi = (columns.index(x) for x in (c, f"{c}_lo", f"{c}_hi"))
        held = [r for r in rows if r[v] is not None]
        bounded = [r for r in held if r[lo] is not None and r[hi] is not None]
        if not bounded:
            parts.append(f"{c}: no intervals, so no count of the heads above 0")
            continue
        above = sum(1 for r in bounded if r[lo] > 0)
        below = sum(1 for r in bounded if r[hi] < 0)
        said = f"{c}: {above} of {len(held)} heads above 0 with 95% confidence (lower bound > 0)"
        if c == "importance":
            said += " (|∂O/∂ξ| ≥ 0 by construction: above 0 means measurably above)"
        else:
            said += (
                f", {below} below 0 (upper bound < 0): {above + below} matter individually (the interval excludes 0)"
            )
            if drift:
                said += (
                    f" ({recorded[0]['objective']}: 1 − cos ≥ 0 for any change, so every effect is ≥ 0 by construction "
                    "and above 0 means measurably above, not a finding)"
                )
        parts.append(said)
    return "; ".join(parts)
