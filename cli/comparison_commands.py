"""Judging heads against a floor: `compare` (two runs, or a run and its random-weights controls)
and `query roles` (the head atlas)."""

from __future__ import annotations

import typer

from headatlas.cli import options
from headatlas.cli.console import print_wrapped, stdout
from headatlas.cli.formats import Format, TableView, render
from headatlas.cli.messages import note
from headatlas.cli.metric_tables import render_metrics
from headatlas.cli.query_commands import _interval_warnings, _print_warnings, _run, _store
from headatlas.service.wording import counted

DbOpt, RunOpt, FormatOpt, AtOpt = options.Db, options.Run, options.Fmt, options.At
ColumnsOpt, WideOpt = options.Columns, options.Wide


def register(app: typer.Typer, query_app: typer.Typer) -> None:
    app.command()(compare)
    query_app.command("roles")(query_roles)


def compare(
    run_a: str = typer.Argument(..., help="Run A: id or name."),
    run_b: str | None = typer.Argument(
        None,
        help="Run B: id or name (default: each of run A's random-weights controls, from analyze --control N; "
        "with several, JSON and CSV rows start with run_b).",
    ),
    metric: list[str] = typer.Option(
        [], "--metric", "-M", help="A metric of `query layers` (repeat); default: the main lifts and shares."
    ),
    layer: int | None = typer.Option(
        None, "--layer", "-l", help="Only this layer of run A (0-based); with --heads or --head: its heads."
    ),
    head: int | None = typer.Option(None, "--head", help="Only this head (0-based, needs --layer)."),
    heads: bool = typer.Option(False, "--heads", help="Compare heads instead of layers (runs of the same shape only)."),
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Two runs side by side per layer (or head): both values, A − B, and whether the difference
    is beyond the runs' 95% intervals. Depths that differ are aligned by relative depth."""
    from headatlas.service.reports import compare as comparison
    from headatlas.service.reports import query_support
    from headatlas.service.reports.intervals import groups_held, scheme_of

    with _store(db, at).checked_read() as conn:
        a = _run(conn, run_a)
        found = comparison.comparisons(
            conn,
            a,
            _run(conn, run_b) if run_b is not None else None,
            metrics=metric,
            layer=layer,
            head=head,
            heads=heads,
        )
        results = [(b, (names, rows)) for b, names, rows in found]
        bs = [b for b, _ in results]
        held = {x.run_id: groups_held(conn, x.run_id) for x in (a, *bs)}
        sink = {b.run_id: comparison.first_token_note(conn, [a, b], rows) for b, _, rows in found}
        unreliable = _interval_warnings(conn, a, *bs)
    # the answer in 100 columns: both values, the difference with its interval, the verdict
    # (each value's own interval is in --wide, CSV and JSON); layer_b only where depths differ
    same_depth = all(b.n_layers == a.n_layers for b in bs)
    table = [
        c
        for c in comparison.TABLE_COLUMNS
        if not (c == "head" and not (heads or head is not None)) and not (c == "layer_b" and same_depth)
    ]
    view = TableView.of(columns, wide)
    if fmt != Format.table and len(results) > 1:  # one document: every control's rows, named
        names = ["run_b", *results[0][1][0]]
        render(names, [(b.run_id, *r) for b, (_, rows) in results for r in rows], fmt, view=view)
        _print_warnings(unreliable)
        return
    for b, (names, rows) in results:
        floor = comparison.floor_note(a, b)
        differ = comparison.parameter_differences(a, b)
        if differ and fmt == Format.table:
            note(f"the runs were analysed with different parameters ({'; '.join(differ)})")
        render_metrics(
            names,
            rows,
            fmt,
            table_columns=table,
            view=view,
            intervals=comparison.TABLE_INTERVALS,
            note=f"{comparison.VERDICT_NOTE}. {query_support.LIFT_NOTE}"
            + (f" {said}." if (said := sink[b.run_id]) else ""),
            schemes=[scheme_of(a.params), scheme_of(b.params)],
            groups=[held[a.run_id], held[b.run_id]],
            title=f"A = run {a.run_id} ({a.name}, {a.n_layers} layers) vs B = run {b.run_id} ({b.name}, "
            f"{b.n_layers} layers){floor}",
        )
    _print_warnings(unreliable)


def query_roles(
    run: str | None = RunOpt,
    stability: bool = typer.Option(
        False,
        "--stability",
        help="Also test every role on each half of the run's replicate groups (alternate groups in id order: disjoint sets of "
        "documents where groups hold whole documents) and mark it stable when it holds on both.",
    ),
    layer: int | None = typer.Option(None, "--layer", "-l", help="Only the heads of this layer (0-based)."),
    head: int | None = typer.Option(None, "--head", help="Only this head (0-based; of every layer, or of --layer)."),
    role: str | None = typer.Option(
        None,
        "--role",
        help="Only the heads that hold this role (`previous-token`, `induction`, …; `none` for none established). "
        "The tests and their Holm family stay the whole run's.",
    ),
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """The head atlas: one row per (head, role) with the evidence that earned it (metric, value,
    95% interval, threshold, p and its Holm-adjusted p over the run's family of tests; rules in
    SPEC §7). Heads without a role: "none established". A table also counts each role, and what
    the run's random-weights controls earn. --layer, --head and --role choose the rows shown."""
    from headatlas.service.reports.intervals import scheme_of
    from headatlas.service.reports.role_table import role_table

    with _store(db, at).checked_read() as conn:
        r = _run(conn, run)
        atlas = role_table(conn, r, stability=stability, layer=layer, head=head, role=role)
        effect_lines = _role_effect_lines(conn, r.run_id, atlas.names, atlas.every)
    names, rows = atlas.names, atlas.rows
    # the probe's columns where a role read a probe score (decoders' induction and duplicate-token)
    probed = any(row[names.index("probe_score")] is not None for row in atlas.every)
    hidden = ("rule", "test", "p", "family") + (() if probed else ("probe_score", "probe_min"))
    table = [c for c in names if c not in hidden]
    # where the table does not fit, the evidence yields before the answer: the role, its value and
    # the head's effect stay (and, with --stability, whether the role held on each half)
    yields: tuple[str, ...] = ("primary", "p_holm", "threshold", "metric")
    if stability:  # the answer: each role's value and whether it held on each half (evidence in --wide)
        table = [c for c in table if c not in ("primary", "threshold", "p_holm")]
        yields = ("metric", "effect", "value")
    render_metrics(
        names,
        rows,
        fmt,
        title=f"run {r.run_id} ({r.name}): head roles (SPEC §7); {atlas.tested}{atlas.chosen}",
        table_columns=table,
        note=atlas.note,
        schemes=[scheme_of(r.params)],
        view=TableView.of(columns, wide),
        pinned=3,
        intervals=() if stability else ("value",),
        groups=[atlas.groups],
        yields=yields,
    )
    if fmt != Format.table:
        return
    print_wrapped(atlas.counts_line())
    for line in effect_lines:
        print_wrapped(line)
    if stability and atlas.counts()[1] is None:
        stdout.print("stability: a half holds under 2 replicate groups; no test on halves", markup=False)
    for line in atlas.control_lines():
        stdout.print(line, markup=False, highlight=False)


def _role_effect_lines(conn, run_id: int, names: list[str], rows: list[tuple]) -> list[str]:
    """Under `query roles` of a run with effects: what each role's heads cost when removed (SPEC §9)."""
    from headatlas.service.reports import role_effects
    from headatlas.service.storage.effect_rows import effect_note, run_effects

    per_role = role_effects.by_role(conn, run_id, names, rows)
    found = run_effects(conn, run_id)
    if per_role is None or not found:
        return []
    unit = found[0]["unit"]
    parts = [
        role_effects.describe(f"{role} ({counted(n, 'head')})", value, lo, hi, unit)
        + (f", {gap_text}" if (gap_text := role_effects.against_none(gap, g_lo, g_hi)) else "")
        for role, n, value, lo, hi, gap, g_lo, g_hi in per_role
    ]
    shown = "primary role; 95% intervals" if role_effects.has_intervals(per_role) else "primary role"
    lines = [f"mean effect of each role's heads ({shown}): {'; '.join(parts)}"]
    return lines + [said] if (said := effect_note(conn, run_id)) else lines
