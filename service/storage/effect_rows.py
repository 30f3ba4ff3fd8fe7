"""The rows of the causal effects (SPEC §9) that are not additive sums: what a run's effects are
measured against (``run_effects``, migration 0013) and the stored pruning curves (``prunes``,
``prune_curves``, migration 0014). Written inside the caller's transaction, on either backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.engine import Connection

EFFECT_FIELDS = (
    "objective",
    "unit",
    "kinds",
    "reference_windows",
    "reference_positions",
    "reference_fingerprint",
    "means_fingerprint",
)


def insert_run_effects(conn: Connection, run_id: int, metas: list[dict]) -> None:
    """Record what the batches' effects were measured against: one row per distinct set of
    means, inserted where absent (a lake has no keys: two writers storing the first effect
    batches of one run at the same instant may each insert it, and readers take one per set)."""
    seen: dict[str, dict] = {}
    for meta in metas:
        if meta and meta.get("windows"):
            seen.setdefault(str(meta.get("means_fingerprint") or ""), meta)
    for fingerprint, meta in seen.items():
        values = {
            "r": run_id,
            "objective": meta["objective"],
            "unit": meta["unit"],
            "kinds": ",".join(meta["kinds"]),
            "reference_windows": int(meta.get("reference_windows") or 0),
            "reference_positions": int(meta.get("reference_positions") or 0),
            "reference_fingerprint": str(meta.get("reference_fingerprint") or ""),
            "means_fingerprint": fingerprint,
        }
        conn.execute(
            text(
                "INSERT INTO run_effects (run_id, objective, unit, kinds, reference_windows, reference_positions, "
                "reference_fingerprint, means_fingerprint) SELECT :r, :objective, :unit, :kinds, :reference_windows, "
                ":reference_positions, :reference_fingerprint, :means_fingerprint WHERE NOT EXISTS "
                "(SELECT 1 FROM run_effects WHERE run_id = :r AND means_fingerprint = :means_fingerprint)"
            ),
            values,
        )


def run_effects(conn: Connection, run_id: int) -> list[dict]:
    """What run ``run_id``'s effects are measured against, one dict per set of means (none for a
    run without effects)."""
    rows = conn.execute(
        text(
            f"SELECT DISTINCT {', '.join(EFFECT_FIELDS)} FROM run_effects WHERE run_id = :r ORDER BY means_fingerprint"
        ),
        {"r": run_id},
    ).all()
    return [dict(zip(EFFECT_FIELDS, r)) for r in rows]


def effect_windows(conn: Connection, run_id: int) -> int:
    """Windows of the run whose effects are stored (those whose objective is defined)."""
    value = conn.execute(
        text("SELECT coalesce(sum(effect_windows), 0) FROM run_chance WHERE run_id = :r"), {"r": run_id}
    ).scalar()
    return int(value or 0)


def effect_groups(conn: Connection, run_id: int) -> frozenset[int]:
    """The replicate groups (SPEC §5d) that hold the run's effect windows: the groups an effect's
    jackknife drops one at a time. The run's effect windows are ``--effect-windows`` of its
    windows, so they often fill fewer groups than the run's windows do; a group without effect windows
    leaves every effect unchanged when dropped, and counting it would narrow the interval (more
    groups in (R − 1)/R and in the t quantile than the effects rest on)."""
    rows = conn.execute(
        text("SELECT DISTINCT rep FROM run_chance WHERE run_id = :r AND effect_windows > 0 AND rep IS NOT NULL"),
        {"r": run_id},
    ).all()
    return frozenset(int(r[0]) for r in rows)


def effect_note(conn: Connection, run_id: int) -> str | None:
    """The line under a table of effects: what they are measured against, on which windows, and
    the replicate groups their intervals rest on, for this run."""
    from headatlas.service.engine.effect_spread import group_cap
    from headatlas.service.engine.schemes import MIN_GROUPS
    from headatlas.service.wording import counted

    found = run_effects(conn, run_id)
    if not found:
        return None
    first = found[0]
    windows = effect_windows(conn, run_id)
    asked, spread, stored = conn.execute(
        text(
            "SELECT (SELECT CAST(json_extract_string(params, '$.effect_windows') AS BIGINT) FROM runs "
            "WHERE run_id = :r), (SELECT json_extract_string(params, '$.effect_spread') FROM runs WHERE run_id = :r), "
            "(SELECT coalesce(sum(windows), 0) FROM run_chance WHERE run_id = :r)"
        ),
        {"r": run_id},
    ).one()
    # N windows of the run carry the effects (SPEC §9), spread over its replicate groups (runs stored
    # before: its first N by position): one whose objective is undefined (a decoder window of one
    # token) is among them and measured by nothing
    span = min(int(asked), int(stored)) if asked is not None else windows
    undefined = span - windows
    chosen = (
        f"{span} windows spread over the run's replicate groups (at most {group_cap(int(asked))} in a group, where "
        "the corpus has enough)"
        if spread == "groups" and asked is not None
        else f"the run's first {span} windows"
    )
    among = chosen + (
        f" less {undefined} whose objective is undefined (a window of one token)" if undefined > 0 else ""
    )
    groups = len(effect_groups(conn, run_id))
    kinds = first["kinds"].split(",")
    parts = []
    if "zero" in kinds:
        parts.append("effect_zero: the head's output set to 0")
    if "mean" in kinds:
        parts.append(f"effect_mean: set to its mean over the run's first {first['reference_windows']} windows")
    if "gradient" in kinds:
        parts.append("importance: mean |∂O/∂ξ| at the intact model")
    if "atp" in kinds:
        parts.append(
            f"effect_atp: attribution patching, effect_mean's first-order estimate (Σ (m − z)·∂O/∂z, m the mean "
            f"over the run's first {first['reference_windows']} windows)"
        )
    means = f"; {len(found)} sets of reference means were used" if len(found) > 1 else ""
    if groups < 2:
        # the jackknife leaves one group out: with one group there is nothing to leave out
        intervals = (
            f"no intervals: these windows fall in {counted(groups, 'replicate group')}, and an interval needs 2 or more "
            f"(measure windows of more documents, or more windows: --effect-windows, `headatlas effects`)"
        )
    else:
        rough = f", fewer than {MIN_GROUPS}: their widths are rough" if groups < MIN_GROUPS else ""
        intervals = f"their intervals: the jackknife over the {groups} replicate groups that hold these windows{rough}"
    return (
        f"effect_* = O(ablated) − O(intact), O = {first['objective']} ({first['unit']}), mean over {among} "
        f"({'; '.join(parts)}); drift_*: output drift of the final hidden states, "
        f"0 = unchanged (SPEC §9); {intervals}{means}"
    )


# --- pruning curves ------------------------------------------------------------------------------

PRUNE_FIELDS = (
    "prune_id",
    "created_at",
    "objective",
    "unit",
    "orders",
    "step",
    "seeds",
    "evaluation_windows",
    "selection",
    "reference_windows",
    "scheme",
    "groups",
    "area",
    "area_lo",
    "area_hi",
    "rho",
    "rho_lo",
    "rho_hi",
    "claim",
    "seconds",
    "retrieval_queries",
    "retrieval_candidates",
    "chance_top1",
    "chance_mrr",
)
# neighbour retrieval beside an embedding objective (migration 0018): NULL where the objective has none
RETRIEVAL_COLUMNS = ("top1", "top1_lo", "top1_hi", "mrr", "mrr_lo", "mrr_hi")
CURVE_COLUMNS = (
    "order",
    "step",
    "heads_removed",
    "fraction",
    "objective",
    "objective_lo",
    "objective_hi",
    "increase",
    "increase_lo",
    "increase_hi",
    *RETRIEVAL_COLUMNS,
)


@dataclass
class StoredPrune:
    """A stored prune: how it was made and the claim (``meta``, PRUNE_FIELDS), and its curve rows
    (CURVE_COLUMNS, plus the heads removed at each step in ``removed``; the retrieval columns only
    where the prune measured retrieval: a loss's or a decoder's curves read as they always did)."""

    run_id: int
    meta: dict
    columns: list[str] = field(default_factory=lambda: list(CURVE_COLUMNS))
    rows: list[tuple] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


def _number(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


def store_prune(conn: Connection, run_id: int, meta: dict, rows: list[tuple], removed: list[str]) -> int:
    """Store one prune of run ``run_id`` (``meta``: PRUNE_FIELDS less ``prune_id`` and
    ``created_at``; ``rows``: CURVE_COLUMNS; ``removed``: per row, the heads removed at that step).
    Returns its ``prune_id``."""
    prune_id = int(
        conn.execute(
            text("SELECT coalesce(max(prune_id), 0) + 1 FROM prunes WHERE run_id = :r"), {"r": run_id}
        ).scalar()
        or 1
    )
    values = {k: meta[k] for k in PRUNE_FIELDS if k not in ("prune_id", "created_at")}
    for k in ("area", "area_lo", "area_hi", "rho", "rho_lo", "rho_hi", "chance_top1", "chance_mrr"):
        values[k] = _number(values[k])
    names = ", ".join(values)
    conn.execute(
        text(
            f"INSERT INTO prunes (run_id, prune_id, created_at, {names}) "
            f"VALUES (:r, :p, now(), {', '.join(':' + k for k in values)})"
        ),
        {"r": run_id, "p": prune_id, **values},
    )
    for row, heads in zip(rows, removed, strict=True):
        cells = dict(zip(CURVE_COLUMNS, row))
        conn.execute(
            text(
                f"INSERT INTO prune_curves (run_id, prune_id, order_name, {', '.join(CURVE_COLUMNS[1:])}, removed) "
                f"VALUES (:r, :p, :order, {', '.join(':' + c for c in CURVE_COLUMNS[1:])}, :removed)"
            ),
            {
                "r": run_id,
                "p": prune_id,
                **{k: (_number(v) if isinstance(v, float) else v) for k, v in cells.items()},
                "removed": heads,
            },
        )
    return prune_id


def stored_prunes(conn: Connection, run_id: int) -> list[dict]:
    """The run's stored prunes (PRUNE_FIELDS), newest first."""
    rows = conn.execute(
        text(f"SELECT {', '.join(PRUNE_FIELDS)} FROM prunes WHERE run_id = :r ORDER BY prune_id DESC"), {"r": run_id}
    ).all()
    return [dict(zip(PRUNE_FIELDS, r)) for r in rows]


def load_prune(conn: Connection, run_id: int, prune_id: int | None = None) -> StoredPrune | None:
    """A stored prune of the run (the newest when ``prune_id`` is None), or None."""
    prunes = stored_prunes(conn, run_id)
    meta = next((p for p in prunes if prune_id is None or p["prune_id"] == prune_id), None)
    if meta is None:
        return None
    columns = list(CURVE_COLUMNS if meta["retrieval_queries"] is not None else CURVE_COLUMNS[: -len(RETRIEVAL_COLUMNS)])
    found = conn.execute(
        text(
            f"SELECT order_name, {', '.join(columns[1:])}, removed FROM prune_curves WHERE run_id = :r AND prune_id = :p "
            "ORDER BY CASE WHEN order_name LIKE 'random:%' THEN 1 ELSE 0 END, order_name, step"
        ),
        {"r": run_id, "p": meta["prune_id"]},
    ).all()
    return StoredPrune(run_id, meta, columns, rows=[tuple(r[:-1]) for r in found], removed=[r[-1] for r in found])


def retrieval_note(meta: dict) -> str | None:
    """What a prune's retrieval columns mean, with chance, or None where it measured none."""
    if meta.get("retrieval_queries") is None:
        return None
    return (
        f"top1, mrr: neighbour retrieval with the same heads removed: each of the {meta['retrieval_queries']} "
        f"sentences of the evaluation windows that another follows in its window, embedded alone, ranks the "
        f"{meta['retrieval_candidates']} that follow another (less itself) by cosine for its own successor; top1 the "
        f"share ranked first, mrr the mean reciprocal rank (chance {meta['chance_top1']:.3f} and "
        f"{meta['chance_mrr']:.3f}; SPEC §9)"
    )
