"""``headatlas.compare``: two runs side by side, or a run against its random-weights controls, as
``headatlas compare`` shows them (service/reports/compare.py)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

from headatlas.service.api.tables import Table
from headatlas.service.api.terms import in_python_terms


@in_python_terms
def compare(
    db: str | Path | None,
    run_a: str | int,
    run_b: str | int | None = None,
    *,
    metrics: Sequence[str] = (),
    layer: int | None = None,
    head: int | None = None,
    heads: bool = False,
    at: int | None = None,
) -> Table:
    """Run A against run B per layer (or per head: ``heads``, or ``head`` with ``layer``): each
    metric's value in both runs, A − B with its 95% interval (paired where the runs share their
    windows) and the verdict, whether the difference is beyond the interval. ``run_b`` None: each
    of A's random-weights controls (``analyze(..., control=N)``); the first column, ``run_b``,
    says which B a row compares with.
    ``metrics``: those of ``layers()`` (default: the main lifts and shares); depths that differ are
    aligned by relative depth. ``db``: as ``connect`` takes it (None: the default database)."""
    from headatlas.service.api.views import IntervalWarning, connect
    from headatlas.service.operations.runs import find_run, interval_warnings
    from headatlas.service.reports import compare as comparison
    from headatlas.service.reports import query_support
    from headatlas.service.reports.intervals import groups_held, interval_note, scheme_of

    store = connect(db, at=at).store
    with store.checked_read() as conn:
        a = find_run(conn, run_a)
        b = find_run(conn, run_b) if run_b is not None else None
        found = comparison.comparisons(conn, a, b, metrics=list(metrics), layer=layer, head=head, heads=heads)
        runs = [a, *(b for b, _, _ in found)]
        held = [groups_held(conn, r.run_id) for r in runs]
        said = interval_warnings(conn, *runs)
        sink = comparison.first_token_note(conn, runs, [row for _, _, rows in found for row in rows])
    names = ["run_b", *found[0][1]]
    rows = [(b.run_id, *row) for b, _, found_rows in found for row in found_rows]
    notes = [
        f"A = run {a.run_id} ({a.name}, {a.n_layers} layers) vs B = run {b.run_id} ({b.name}, {b.n_layers} layers)"
        + comparison.floor_note(a, b)
        for b, _, _ in found
    ]
    notes += [
        f"run {b.run_id}: the runs were analysed with different parameters ({'; '.join(differ)})"
        for b, _, _ in found
        if (differ := comparison.parameter_differences(a, b))
    ]
    notes += [
        f"{comparison.VERDICT_NOTE}. {query_support.LIFT_NOTE}",
        *([sink] if sink else []),
        interval_note([scheme_of(r.params) for r in runs], held),
    ]
    for warning in said:
        notes.append(f"warning: {warning}")
        warnings.warn(warning, IntervalWarning, stacklevel=3)
    return Table.of(names, rows, what=f"compare, run {a.run_id}", notes=notes)
