"""What the heads of each role cost when removed (SPEC §9 beside §7): every role's evidence with
the head's effect, and the mean effect of each role's heads against the heads without a role.

A head's effect is its stored mean-ablation effect (``effect_mean``; ``effect_zero`` for a run
that measured only zero ablation), O(ablated) − O(intact) in the run's objective. A set of heads'
mean effect gets the §5d interval of every other statistic: the delete-one-group jackknife of the
set's mean, each group's leave-one-out value read from ``head_metrics_reps``, over the groups
that hold the run's effect windows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.reports.intervals import jackknife_halfwidth

EFFECT_ORDER = ("effect_mean", "effect_zero")  # the effect a role is shown with, first stored
ROLE_EFFECT_COLUMNS = ["effect", "effect_lo", "effect_hi"]


def effect_column(conn: Connection, run_id: int) -> str | None:
    """The effect column the run stores (``effect_mean`` before ``effect_zero``), or None."""
    from headatlas.service.reports.effect_queries import held_values

    held = held_values(conn, run_id, EFFECT_ORDER)
    return next((column for column in EFFECT_ORDER if held[column]), None)


def head_effects(conn: Connection, run_id: int, column: str) -> dict[int, dict[tuple[int, int], float]]:
    """``drop_rep → {(layer, head): effect}``: the run's effects, whole (-1) and without each group
    that holds effect windows (``effect_rows.effect_groups``: the others would only narrow it)."""
    from headatlas.service.storage.effect_rows import effect_groups

    groups = effect_groups(conn, run_id)
    out: dict[int, dict[tuple[int, int], float]] = {}
    for layer, head, drop, value in conn.execute(
        text(f"SELECT layer, head, drop_rep, {column} FROM head_metrics_reps WHERE run_id = :r"), {"r": run_id}
    ):
        if value is not None and (drop < 0 or drop in groups):
            out.setdefault(int(drop), {})[(int(layer), int(head))] = float(value)
    return out


def set_effect(effects: dict[int, dict[tuple[int, int], float]], heads: Iterable[tuple[int, int]]):
    """The mean effect of ``heads`` with its 95% interval: ``(value, lo, hi)`` (NaN bounds with
    fewer than two groups)."""
    chosen = list(dict.fromkeys(heads))
    if not chosen or -1 not in effects:
        return math.nan, math.nan, math.nan

    def mean(drop: int) -> float | None:
        values = [effects[drop].get(h) for h in chosen]
        known = [v for v in values if v is not None]
        return float(np.mean(known)) if len(known) == len(values) else None

    value = mean(-1)
    if value is None:
        return math.nan, math.nan, math.nan
    half = jackknife_halfwidth([mean(d) for d in sorted(effects) if d >= 0])
    return (value, math.nan, math.nan) if half is None else (value, value - half, value + half)


def difference(effects, first: Iterable[tuple[int, int]], second: Iterable[tuple[int, int]]):
    """The mean effect of ``first`` minus that of ``second``, with the paired jackknife interval."""
    a, b = list(dict.fromkeys(first)), list(dict.fromkeys(second))
    if not a or not b or -1 not in effects:
        return math.nan, math.nan, math.nan

    def gap(drop: int) -> float | None:
        va = [v for h in a if (v := effects[drop].get(h)) is not None]
        vb = [v for h in b if (v := effects[drop].get(h)) is not None]
        if len(va) < len(a) or len(vb) < len(b):
            return None
        return float(np.mean(va) - np.mean(vb))

    value = gap(-1)
    if value is None:
        return math.nan, math.nan, math.nan
    half = jackknife_halfwidth([gap(d) for d in sorted(effects) if d >= 0])
    return (value, math.nan, math.nan) if half is None else (value, value - half, value + half)


def with_effects(conn: Connection, run_id: int, names: list[str], rows: list[tuple]) -> tuple[list[str], list[tuple]]:
    """The roles' rows with each head's effect and interval (``effect``, ``effect_lo``,
    ``effect_hi``); unchanged for a run without effects."""
    column = effect_column(conn, run_id)
    if column is None:
        return names, rows
    effects = head_effects(conn, run_id, column)
    li, hi = names.index("layer"), names.index("head")
    out = []
    for r in rows:
        value, lo, hi_ = set_effect(effects, [(r[li], r[hi])])
        out.append((*r, *(None if math.isnan(v) else v for v in (value, lo, hi_))))
    return [*names, *ROLE_EFFECT_COLUMNS], out


def by_role(conn: Connection, run_id: int, names: list[str], rows: list[tuple]) -> list[tuple] | None:
    """Per primary role: heads, their mean effect with its interval, and the difference from the
    heads without a role (paired interval). None for a run without effects."""
    from headatlas.service.reports.role_rules import NONE

    column = effect_column(conn, run_id)
    if column is None:
        return None
    effects = head_effects(conn, run_id, column)
    li, hi, ri, pi = (names.index(c) for c in ("layer", "head", "role", "primary"))
    heads: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        if r[pi]:
            heads.setdefault(r[ri], []).append((r[li], r[hi]))
    none = heads.get(NONE, [])
    out = []
    for role, members in heads.items():
        value = set_effect(effects, members)
        gap = difference(effects, members, none) if role != NONE else (math.nan, math.nan, math.nan)
        out.append((role, len(members), *value, *gap))
    return out


BY_ROLE_COLUMNS = ["role", "heads", "effect", "effect_lo", "effect_hi", "minus_none", "minus_none_lo", "minus_none_hi"]


def bracket(lo: float | None, hi: float | None) -> str:
    """`` [lo, hi]`` of a 95% interval; empty where there is none (its effects in fewer than two
    replicate groups: the jackknife's bounds are NaN, never printed)."""
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return ""
    return f" [{lo:+.3g}, {hi:+.3g}]"


def has_intervals(per_role: list[tuple]) -> bool:
    """Whether any role's effect in ``by_role``'s rows has an interval."""
    return any(bracket(lo, hi) for _role, _n, _v, lo, hi, *_gap in per_role)


def describe(role: str, value: float, lo: float, hi: float, unit: str) -> str:
    """ "an induction head whose removal costs +0.31 nats [0.22, 0.40]"."""
    return f"{role}: removal costs {value:+.3g} {unit}{bracket(lo, hi)}"


def against_none(gap: float, lo: float, hi: float) -> str:
    """ "+0.12 against the heads without a role [+0.05, +0.19]"; empty for the heads without one."""
    return "" if math.isnan(gap) else f"{gap:+.3g} against the heads without a role{bracket(lo, hi)}"
