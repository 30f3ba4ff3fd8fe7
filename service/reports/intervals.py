"""95% intervals for ratio metrics: the delete-one-group jackknife over replicate groups (SPEC §5b).

Every additive sum is stored per replicate group (a stable hash of the window id picks one of
``REPLICATES`` groups). The ``*_reps`` views give each metric computed on the whole run
(``drop_rep = -1``) and on the run without each group ``g`` (``drop_rep = g``); from those,

    θ̂ ± z · sqrt((R - 1) / R · Σ_g (θ_(g) - θ̄)²),   θ̄ = mean of θ_(g),

with R the number of groups that hold windows (16 once a run has a few dozen windows). The
interval says how much the metric moves with the sample of windows; it does not cover choices
that are fixed for the run (model, ``select``, ``gate``).

numpy only: the query path stays free of torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

Z95 = 1.959963984540054


def jackknife_halfwidth(leave_one_out: Sequence[float | None], *, z: float = Z95) -> float | None:
    """Half-width of the jackknife interval from the leave-one-group-out estimates, or None
    when it cannot be formed (fewer than 2 groups, or a group's estimate is undefined)."""
    values = [v for v in leave_one_out]
    if len(values) < 2 or any(v is None or not math.isfinite(v) for v in values):
        return None
    loo = np.asarray(values, dtype=np.float64)
    r = len(loo)
    return z * math.sqrt((r - 1) / r * float(((loo - loo.mean()) ** 2).sum()))


def add_intervals(
    columns: list[str],
    rows: list[tuple],
    replicate_rows: Iterable[tuple],
    *,
    keys: Sequence[str],
    metrics: Sequence[str],
) -> tuple[list[str], list[tuple]]:
    """Insert ``<metric>_lo`` and ``<metric>_hi`` after each metric column of ``rows``.

    ``replicate_rows``: tuples ``(*keys, drop_rep, *metrics)`` (drop_rep ≥ 0 only) — the metric
    on the run without each group. A row's interval is centred on its own value, so
    ``lo ≤ value ≤ hi`` always holds; where it cannot be formed (a run stored before replicate
    groups existed, an undefined ratio) both bounds are None.
    """
    k = len(keys)
    loo: dict[tuple, list[list[float | None]]] = {}
    for rep_row in replicate_rows:
        key = tuple(rep_row[:k])
        loo.setdefault(key, []).append(list(rep_row[k + 1 :]))
    key_idx = [columns.index(c) for c in keys]
    metric_idx = {m: columns.index(m) for m in metrics}
    out_columns: list[str] = []
    for column in columns:
        out_columns.append(column)
        if column in metric_idx:
            out_columns += [f"{column}_lo", f"{column}_hi"]
    out_rows = []
    for row in rows:
        groups = loo.get(tuple(row[i] for i in key_idx), [])
        out = []
        for column, value in zip(columns, row):
            out.append(value)
            if column in metric_idx:
                m = list(metrics).index(column)
                half = jackknife_halfwidth([g[m] for g in groups]) if value is not None else None
                out += [None, None] if half is None else [value - half, value + half]
        out_rows.append(tuple(out))
    return out_columns, out_rows
