"""95% intervals for ratio metrics: the delete-one-group jackknife over replicate groups (SPEC §5d).

Every additive sum is stored per replicate group: a stable hash of the window's document (the
default), of a block of consecutive windows of one document, or (runs stored before §5d) of the
window itself picks one of ``REPLICATES`` groups; the run records its scheme. The ``*_reps``
views give each metric computed on the whole run (``drop_rep = -1``) and on the run without each
group ``g`` (``drop_rep = g``); from those,

    θ̂ ± t_{R-1, 0.975} · sqrt((R - 1) / R · Σ_g (θ_(g) - θ̄)²),   θ̄ = mean of θ_(g),

and for a lift (a positive ratio of two sums) the same on ln θ, back-transformed, with degrees of
freedom lowered by the kurtosis of the leave-one-out log lifts (``lift_df``):
θ̂ · exp(∓ t_{df, 0.975} · se(ln θ)) (``jackknife_interval``),

with R the number of groups that hold windows (16 once a run has a few dozen documents). Windows
of one document are correlated; grouping by document keeps them together, so the interval covers
the sampling of documents. It does not cover choices that are fixed for the run (model,
``select``, ``gate``).

The jackknife is symmetric; a metric is not always free to go both ways. Each bound is clipped to
the values the metric can take (``bounds_of``: a share to [0, 1], a lift to ≥ 0), and the note
under every interval says so. With fewer than ``MIN_GROUPS`` groups holding windows an interval
rests on too few estimates to be read (``unreliable_note``).

numpy only: the query path stays free of torch and scipy.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from headatlas.service.engine.results import REPLICATES
from headatlas.service.engine.schemes import MIN_GROUPS  # noqa: F401 - beside REPLICATES, for the store too
from headatlas.service.engine.student_t import (  # noqa: F401 - the t multipliers, read from here too
    DF_STEP,
    incomplete_beta,
    t95,
    t_quantile,
    t_upper_tail,
)
from headatlas.service.metrics import COLUMNS, plugin_metrics
from headatlas.service.wording import counted

Z95 = 1.959963984540054  # the normal quantile (the §5b rule; kept for callers that pass it as z)
WINDOW_SCHEME = "window"  # runs stored before SPEC §5d record no scheme: theirs was by window
_DECLARED_BOUNDS = {c.name: c.bounds for c in COLUMNS}


def lift_df(log_leave_one_out: Sequence[float]) -> float:
    """The degrees of freedom of a lift's interval: R − 1 lowered by the kurtosis of its R
    leave-one-group-out log lifts (SPEC §5d).

    The jackknife variance is a mean of R squared deviations; with excess kurtosis κ of those
    deviations its relative variance is 2/(R − 1) + κ/R, not the 2/(R − 1) of normal ones, and the
    Satterthwaite degrees of freedom that match it are 2 / (2/(R − 1) + κ/R). κ is the
    sample's unbiased excess kurtosis G2 (negative values count as 0, so the result is never above
    R − 1); the result is at least 1 and rounded down to ``DF_STEP``. Where a few documents carry
    most of a lift's denominator, one or two groups' leave-one-out values stand apart, the variance
    rests on them, and the t quantile grows to match (benchmarks/lift_intervals.py). Under 4 groups
    G2 is undefined: R − 1."""
    values = np.asarray(log_leave_one_out, dtype=np.float64)
    r = len(values)
    if r < 4:
        return float(r - 1)
    dev = values - values.mean()
    return _lift_df_of(r, float((dev**2).sum()), float((dev**4).sum()))


def _lift_df_of(r: int, s2: float, s4: float) -> float:
    """``lift_df`` of R values whose squared and fourth-power deviations from their mean sum to
    ``s2`` and ``s4``."""
    if r < 4 or s2 <= 0:
        return float(r - 1)
    g2 = r * s4 / s2**2 - 3.0
    excess = max(0.0, ((r + 1) * g2 + 6.0) * (r - 1) / ((r - 2) * (r - 3)))
    df = min(r - 1.0, max(1.0, 2.0 / (2.0 / (r - 1) + excess / r)))
    return r - 1.0 if df >= r - 1 else max(1.0, math.floor(df / DF_STEP + 1e-9) * DF_STEP)


def scheme_of(params: Mapping | None) -> str:
    """The replicate scheme a run's stored params record (``document``, ``block:B`` or
    ``window``); runs stored before SPEC §5d record none and were grouped by window."""
    return str((params or {}).get("replicates") or WINDOW_SCHEME)


def scheme_words(scheme: str) -> str:
    """How a footnote names a scheme: "by document", "by block of 8 windows", "by window"."""
    unit, _, block = scheme.partition(":")
    if unit == "block":
        return f"by block of {block} consecutive windows of a document"
    return f"by {unit}"


def groups_held(conn, run_id: int) -> int:
    """The replicate groups of a run that hold windows: R of its intervals (SPEC §5d)."""
    from sqlalchemy import text

    row = conn.execute(text("SELECT count(DISTINCT rep) FROM run_reps WHERE run_id = :r"), {"r": run_id}).first()
    return int(row[0]) if row else 0


def groups_words(groups: Iterable[int] | None) -> str:
    """ "16 replicate groups", "12 / 16 replicate groups" (two runs), or, where the counts are not
    at hand, "the replicate groups holding windows (at most 16)"."""
    counts = [] if groups is None else list(dict.fromkeys(int(g) for g in groups if g))
    if not counts:
        return f"the replicate groups holding windows (at most {REPLICATES})"
    return f"{' / '.join(str(g) for g in counts)} replicate group{'s' if counts != [1] else ''}"


def interval_note(schemes: Iterable[str], groups: Iterable[int] | None = None) -> str:
    """The footnote under intervals: the rule, over how many replicate groups (``groups``: those
    holding windows, one count per run shown; R of the jackknife, not always 16) and the replicate
    scheme(s) of the runs shown."""
    named = sorted(set(schemes)) or [WINDOW_SCHEME]
    caveats = []
    if any(s.startswith("block") for s in named):
        caveats.append("by block: the variation within these documents only")
    if WINDOW_SCHEME in named:
        caveats.append("by window: the rule of runs stored before §5d, too narrow (windows of one document correlate)")
    return (
        f"[a, b]: 95% interval, delete-one-group jackknife with the t quantile over {groups_words(groups)} "
        f"{' / '.join(scheme_words(s) for s in named)} (SPEC §5d)"
        + "".join(f"; {c}" for c in caveats)
        + f"; {CLIP_NOTE}; it does not cover the choice of model or parameters."
    )


CLIP_NOTE = (
    "a lift's interval on the log scale, θ·exp(∓t·se of ln θ); "
    "bounds clipped to what the metric can take (a share to [0, 1], a lift to ≥ 0)"
)


def bounds_of(column: str) -> tuple[float | None, float | None]:
    """The values a metric can take, (low, high) with None for unbounded: as declared with it
    (``service.metrics``, an installed plugin's too), else by its name: ``share``/``*_share`` in
    [0, 1], ``lift``/``*_lift`` ≥ 0 (the distance profiles' columns)."""
    if column in _DECLARED_BOUNDS:
        return _DECLARED_BOUNDS[column]
    for c in (c for m in plugin_metrics() for c in m.columns):  # an installed plugin's, as declared
        if c.name == column:
            return c.bounds
    if column == "share" or column.endswith("_share"):
        return (0.0, 1.0)
    if column == "lift" or column.endswith(("_lift", "_lift_dm")):
        return (0.0, None)
    return (None, None)


def clip_interval(
    column: str, lo: float | None, hi: float | None, *, bounds: tuple[float | None, float | None] | None = None
) -> tuple[float | None, float | None]:
    """``lo`` and ``hi`` clipped to the values ``column`` can take (``bounds_of``, or ``bounds``
    where the caller has read them once for a column's many cells)."""
    low, high = bounds_of(column) if bounds is None else bounds
    if lo is not None:
        lo = lo if low is None else max(lo, low)
        lo = lo if high is None else min(lo, high)
    if hi is not None:
        hi = hi if high is None else min(hi, high)
        hi = hi if low is None else max(hi, low)
    return lo, hi


def unreliable_note(groups: int, windows: int) -> str | None:
    """A warning when a run's intervals rest on fewer than MIN_GROUPS replicate groups (None
    otherwise): ``groups`` = groups holding windows, ``windows`` = the run's windows. A run
    without groups (stored before they existed, or with no window yet) has no interval to warn of."""
    if groups >= MIN_GROUPS or groups == 0:
        return None
    return (
        f"intervals unreliable: only {groups} of {REPLICATES} replicate groups hold windows ({counted(windows, 'window')}; "
        f"they need {MIN_GROUPS} or more): analyse more text, of 10 documents or more"
    )


def jackknife_halfwidth(leave_one_out: Sequence[float | None], *, z: float | None = None) -> float | None:
    """Half-width of the jackknife interval from the leave-one-group-out estimates (one per group
    holding windows), or None when it cannot be formed (fewer than 2 groups, or a group's estimate
    is undefined). The multiplier is t_{R-1, 0.975} (SPEC §5d) unless ``z`` is given."""
    values = [v for v in leave_one_out]
    if len(values) < 2 or any(v is None or not math.isfinite(v) for v in values):
        return None
    loo = np.asarray(values, dtype=np.float64)
    r = len(loo)
    multiplier = t95(r - 1) if z is None else z
    return multiplier * math.sqrt((r - 1) / r * float(((loo - loo.mean()) ** 2).sum()))


def on_log_scale(column: str) -> bool:
    """Whether ``column``'s interval is formed on the log scale: a lift (``lift``, ``*_lift``,
    ``*_lift_dm``), a positive ratio of two sums whose sampling is skewed where documents
    contribute few, heavy-tailed sums (benchmarks/lift_intervals.py)."""
    return column == "lift" or column.endswith(("_lift", "_lift_dm"))


def jackknife_se(values: Sequence[float]) -> float:
    """The jackknife standard error from leave-one-group-out values: sqrt((R − 1)/R · Σ (θ_(g) − θ̄)²)."""
    loo = np.asarray(values, dtype=np.float64)
    r = len(loo)
    return math.sqrt((r - 1) / r * float(((loo - loo.mean()) ** 2).sum()))


def jackknife_pivot(
    column: str, value: float, leave_one_out: Sequence[float | None], *, log_lifts: bool = True
) -> tuple[bool, float, float, float] | None:
    """What ``column``'s interval and its role test (§7) rest on: (on the log scale, centre,
    standard error, degrees of freedom), or None where no interval can be formed (fewer than 2
    groups, an undefined leave-one-out value). A lift (``on_log_scale``, with ``log_lifts``):
    centre ln θ̂, the jackknife standard error of ln θ and ``lift_df``; where θ̂ or a leave-one-out
    lift is 0 there is no log, and the linear jackknife with R − 1. Every other metric: θ̂, se(θ),
    R − 1."""
    values = list(leave_one_out)
    if len(values) < 2 or any(v is None or not math.isfinite(v) for v in values):
        return None
    r = len(values)
    if log_lifts and on_log_scale(column) and value > 0 and all(v > 0 for v in values):  # type: ignore[operator]
        logs = [math.log(v) for v in values]  # type: ignore[arg-type]
        return True, math.log(value), jackknife_se(logs), lift_df(logs)
    return False, value, jackknife_se(values), float(r - 1)  # type: ignore[arg-type]


def jackknife_interval(
    column: str, value: float, leave_one_out: Sequence[float | None], *, log_lifts: bool = True
) -> tuple[float, float] | None:
    """The 95% interval of ``value`` (unclipped), or None where it cannot be formed
    (``jackknife_pivot``).

    A lift (``on_log_scale``) with ``log_lifts``: the jackknife of ln θ, back-transformed, with
    the t quantile at ``lift_df`` degrees of freedom: ``θ̂ · exp(∓ t_df · se(ln θ))``, asymmetric,
    always positive. On clustered corpora of 10-500 documents whose rates and lifts are
    heavy-tailed (benchmarks/lift_intervals.py) the linear jackknife with t_{R−1} held the truth
    88.3% of the time, the log one 90.4%, the log one with ``lift_df`` 92.7%; on well-behaved lifts
    94.0% → 95.4% (docs/benchmarks.md). Where the value or a leave-one-out lift is 0 there is no log: the linear
    jackknife. Every other metric: ``θ̂ ± t_{R-1} · se(θ)``."""
    pivot = jackknife_pivot(column, value, leave_one_out, log_lifts=log_lifts)
    return None if pivot is None else _bounds(value, pivot)


def _bounds(value: float, pivot: tuple[bool, float, float, float]) -> tuple[float, float]:
    log_scale, _, se, df = pivot
    half = t95(df) * se
    return (value * math.exp(-half), value * math.exp(half)) if log_scale else (value - half, value + half)


def jackknife_pivots(
    column: str, cells: Sequence[tuple[float | None, Sequence[float | None]]], *, log_lifts: bool = True
) -> list[tuple[bool, float, float, float] | None]:
    """``jackknife_pivot`` of each ``(value, leave_one_out)`` of one column (a None value: None),
    number for number: the sums over each cell's groups are numpy's reductions along the rows of one
    array per group count, which add in the order a one-cell array's reduction does
    (tests/test_intervals.py), so a run's thousands of intervals cost a few array operations,
    not a few numpy calls each."""
    out: list[tuple[bool, float, float, float] | None] = [None] * len(cells)
    log_column = log_lifts and on_log_scale(column)
    # (groups, on the log scale) -> (cell indices, their centres, the values their jackknife reads)
    batches: dict[tuple[int, bool], tuple[list[int], list[float], list[list[float]]]] = {}
    for i, (value, leave_one_out) in enumerate(cells):
        values = list(leave_one_out)
        if value is None or len(values) < 2 or any(v is None or not math.isfinite(v) for v in values):
            continue
        if log_column and value > 0 and all(v > 0 for v in values):  # type: ignore[operator]
            key, centre, read = (len(values), True), math.log(value), [math.log(v) for v in values]  # type: ignore[arg-type]
        else:
            key, centre, read = (len(values), False), value, values  # type: ignore[assignment]
        batch = batches.setdefault(key, ([], [], []))
        batch[0].append(i)
        batch[1].append(centre)
        batch[2].append(read)
    for (r, log_scale), (indices, centres, rows) in batches.items():
        loo = np.array(rows, dtype=np.float64)  # [cell, group]
        dev = loo - loo.mean(axis=1)[:, None]
        squares = (dev**2).sum(axis=1)
        fourths = (dev**4).sum(axis=1) if log_scale and r >= 4 else squares
        for i, centre, s2, s4 in zip(indices, centres, squares.tolist(), fourths.tolist()):
            se = math.sqrt((r - 1) / r * s2)
            out[i] = (log_scale, centre, se, _lift_df_of(r, s2, s4) if log_scale else float(r - 1))
    return out


def _key_getter(indices: list[int]) -> Callable[[Sequence], tuple]:
    """A row's key at ``indices``, always a tuple (``itemgetter`` of one index gives the item)."""
    if len(indices) == 1:
        (only,) = indices
        return lambda row: (row[only],)
    return operator.itemgetter(*indices)


def add_intervals(
    columns: list[str],
    rows: list[tuple],
    replicate_rows: Iterable[tuple],
    *,
    keys: Sequence[str],
    metrics: Sequence[str],
    scheme: str | None = None,
    clip: bool = True,
    log_lifts: bool = True,
    groups_of: Mapping[str, Collection[int]] | None = None,
    with_df: bool = False,
) -> tuple[list[str], list[tuple]]:
    """Insert ``<metric>_lo`` and ``<metric>_hi`` after each metric column of ``rows``; with
    ``scheme`` (the run's, ``scheme_of``), also a last column ``interval_by`` naming it.

    ``replicate_rows``: tuples ``(*keys, drop_rep, *metrics)`` (drop_rep ≥ 0 only) — the metric
    on the run without each group. A row's interval is centred on its own value, then clipped to
    what the metric can take (``clip_interval``; ``clip=False``: unclipped, for tests that read the
    half-width), so ``lo ≤ value ≤ hi`` always holds; where it cannot be formed (a run stored
    before replicate groups existed, an undefined ratio) both bounds are None. A lift's interval is
    formed on the log scale with its own degrees of freedom (``jackknife_interval``);
    ``log_lifts=False``: the symmetric linear one with R − 1 (kept for comparison: what every
    interval was before). ``with_df``: also ``<metric>_df`` after ``<metric>_hi``, the degrees of
    freedom of the t quantile behind the interval (what the role tests read, role_tests.py, with the
    unclipped bounds). ``groups_of``: for a metric measured on some windows only (the causal
    effects, SPEC §9), the groups that hold those windows: its jackknife drops these alone.
    """
    k = len(keys)
    loo: dict[tuple, list[tuple[int, tuple]]] = {}
    for rep_row in replicate_rows:
        key = tuple(rep_row[:k])
        loo.setdefault(key, []).append((int(rep_row[k]), tuple(rep_row[k + 1 :])))
    only = groups_of or {}
    key_of = _key_getter([columns.index(c) for c in keys])
    metric_idx = {m: columns.index(m) for m in metrics}
    out_columns: list[str] = []
    for column in columns:
        out_columns.append(column)
        if column in metric_idx:
            out_columns += [f"{column}_lo", f"{column}_hi"] + ([f"{column}_df"] if with_df else [])
    # each row's groups, and each metric's leave-one-out values over them (one transpose per row)
    row_groups = [loo.get(key_of(row), ()) for row in rows]
    by_metric = [tuple(zip(*(g for _, g in groups))) for groups in row_groups]
    # each metric's pivots, for every row at once (jackknife_pivots)
    pivots: dict[str, list[tuple[bool, float, float, float] | None]] = {}
    metric_list = list(metrics)
    for column in dict.fromkeys(metrics):
        m, mi = metric_list.index(column), metric_idx[column]
        kept = only.get(column)
        cells: list[tuple[float | None, Sequence[float | None]]]
        if kept is None:
            cells = [(row[mi], per[m] if per else ()) for row, per in zip(rows, by_metric)]
        else:
            cells = [(row[mi], [g[m] for d, g in groups if d in kept]) for row, groups in zip(rows, row_groups)]
        pivots[column] = jackknife_pivots(column, cells, log_lifts=log_lifts)
    # each metric column's cells of the output row, for every row: value, bounds (and df)
    cells_of: dict[int, list[tuple]] = {}
    missing = (None,) * (3 if with_df else 2)
    for column, i in metric_idx.items():
        limits = bounds_of(column)  # once per column, not per cell
        formed: list[tuple] = []
        for row, pivot in zip(rows, pivots[column]):
            if pivot is None:
                formed.append(missing)
                continue
            bounds: tuple[float | None, float | None] = _bounds(row[i], pivot)
            if clip:
                bounds = clip_interval(column, *bounds, bounds=limits)
            formed.append((*bounds, pivot[3]) if with_df else bounds)
        cells_of[i] = formed
    out_rows = []
    for n, row in enumerate(rows):
        out: list = []
        for i, value in enumerate(row):
            out.append(value)
            formed_cells = cells_of.get(i)
            if formed_cells is not None:
                out += formed_cells[n]
        out_rows.append(tuple(out) if scheme is None else (*out, scheme))
    return (out_columns if scheme is None else [*out_columns, "interval_by"]), out_rows
