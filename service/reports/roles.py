"""A run's head atlas from the store (SPEC §7): the role tests (``role_tests.assign``) on the run's
metrics and intervals, and the run-level chances the thresholds are measured against.

``--stability``: the same tests on each half of the run's replicate groups (``halves``), and a
role is stable when it holds on both.

The rules: ``role_rules``; reading the rows (counts, filters, the primary grid): ``role_views``.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.reports import halves, queries, query_support
from headatlas.service.reports.attention_kind import causal_run
from headatlas.service.reports.role_rules import NONE, PROBE_SCORES, ROLE_METRICS
from headatlas.service.reports.role_tests import COLUMNS, assign

STABILITY_NOTE = (
    "half_a / half_b: the same test on the run's alternate replicate groups only (1st, 3rd, … and 2nd, 4th, … in id order) (each half its own metrics, "
    "jackknife and Holm family); stable: held on both halves"
)
STABILITY_COLUMNS = ["half_a", "half_b", "stable"]


def run_context(conn: Connection, run_id: int) -> dict:
    """The run-level chances the thresholds are measured against."""
    row = (
        conn.execute(
            text(
                "SELECT ln(c.attn_rows / nullif(c.windows, 0)) AS uniform_entropy, d.short_range_chance "
                "FROM chance_totals c LEFT JOIN chance_distance d USING (run_id) WHERE c.run_id = :run"
            ),
            {"run": run_id},
        )
        .mappings()
        .first()
    )
    return dict(row) if row else {"uniform_entropy": None, "short_range_chance": None}


def roles(conn: Connection, run_id: int, *, stability: bool = False) -> query_support.Rows:
    """Per (head, role): the evidence that earned it (metric, value, 95% interval, threshold, p,
    Holm-adjusted p, family size). ``stability``: also ``half_a``, ``half_b`` (held on the run's
    alternate replicate groups alone) and ``stable`` (both). A finished run's stored roles are read
    while they are current (``reports.stored``)."""
    from headatlas.service.storage import run_results as stored

    kept = stored.load(conn, run_id, "roles")
    if kept is not None:
        columns, rows = kept
        if stability:
            return columns, rows
        return columns[: len(COLUMNS)], [r[: len(COLUMNS)] for r in rows]
    with query_support.one_read():  # the heads, their intervals and the halves: the view chain planned once
        columns, rows = queries.heads(
            conn, run_id, anchors=0, ci=True, clip=False, with_df=True
        )  # the tests' intervals
        dicts = [dict(zip(columns, r)) for r in rows]
        groups = halves.run_groups(conn, run_id)
        context = {**run_context(conn, run_id), "causal": causal_run(conn, run_id)}
        out = assign(dicts, context, groups=len(groups) or None)
        if not stability:
            return list(COLUMNS), out
        # the probe is one per run: each half reads the run's probe scores
        probes = {(d["layer"], d["head"]): {k: d.get(k) for k in PROBE_SCORES} for d in dicts}
        # both halves from one plan of the view chain (``halves.subsets_head_rows``); under 2 groups, no
        # test; nor where the run earned no role, as a role not earned has no halves to be held on
        ri = COLUMNS.index("role")
        both = halves.split(groups)
        earned = any(r[ri] != NONE for r in out)
        tested = [half for half in both if len(half) >= 2] if earned else []
        found = iter(halves.subsets_head_rows(conn, run_id, tested, ROLE_METRICS) if tested else [])
        held = [
            _held_on(next(found), len(half), context["causal"], probes) if half in tested else None for half in both
        ]
        marked = []
        for r in out:
            key = (r[0], r[1], r[ri])
            flags = [None if h is None or r[ri] == NONE else key in h for h in held]
            stable = None if None in flags else all(flags)
            marked.append((*r, *flags, stable))
        return [*COLUMNS, *STABILITY_COLUMNS], marked


def _held_on(
    found: tuple[list[str], list[tuple], dict], groups: int, causal: bool, probes: Mapping[tuple, Mapping]
) -> set[tuple]:
    """The (layer, head, role) earned on a subset of ``groups`` replicate groups alone, from its
    rows (``halves.subsets_head_rows``). ``probes``: the run's probe scores per (layer, head)."""
    columns, rows, context = found
    dicts = [{**dict(zip(columns, r)), **probes.get((r[0], r[1]), {})} for r in rows]
    held = assign(dicts, {**context, "causal": causal}, groups=groups)
    return {(r[0], r[1], r[2]) for r in held if r[2] != NONE}
