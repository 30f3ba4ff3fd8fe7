"""Questions to one stored run: `query heads|distances|boundaries|layers|mixing|discrepancy|examples`."""

from __future__ import annotations

import typer

from headatlas.cli import options, run_commands
from headatlas.cli.console import stdout
from headatlas.cli.formats import Format, TableView, render
from headatlas.cli.messages import said
from headatlas.cli.metric_tables import render_metrics
from headatlas.cli.sparklines import sparkline
from headatlas.service.reports.columns import SORTABLE, TERMINAL_HEAD_TABLE

query_app = typer.Typer(help="Ask a stored run about its heads (layers and heads are 0-based).", no_args_is_help=True)

DbOpt, RunOpt, FormatOpt, CiOpt, AtOpt = options.Db, options.Run, options.Fmt, options.Ci, options.At
ColumnsOpt, WideOpt = options.Columns, options.Wide


def register(app: typer.Typer) -> None:
    app.add_typer(query_app, name="query")
    for name, command in (
        ("heads", query_heads),
        ("distances", query_distances),
        ("boundaries", query_boundaries),
        ("layers", query_layers),
        ("mixing", query_mixing),
        ("discrepancy", query_discrepancy),
        ("examples", query_examples),
    ):
        query_app.command(name)(command)


# what a table shows by default (JSON and CSV hold every column; --columns picks, --wide shows all):
# each set fits 100 characters on the shipped excerpt (a narrower table leaves columns out from the right).
# The heads' is declared with the columns (service.metrics, ``shown``), an installed plugin's too
HEAD_TABLE = TERMINAL_HEAD_TABLE
LAYER_TABLE = [
    "layer",
    "mean_distance",
    "within_sentence_lift_dm",
    "repetition_words_lift_dm",
    "attn_to_cls_lift",
]

BOUNDARY_TABLE = [
    "layer",
    "within_sentence_lift_dm",
    "within_sentence_lift",
    "heads_above_chance_dm",
    "attn_to_punct_lift",
]


def _store(db: str, at: int | None = None):
    from headatlas.service.storage.store import Store

    return Store(db, at=at)


def query_heads(
    run: str | None = RunOpt,
    layer: int | None = typer.Option(None, "--layer", "-l", help="Only this layer (0-based)."),
    sort: str | None = typer.Option(
        None,
        "--sort",
        "-s",
        metavar="METRIC",
        help=(
            f"Sort by this metric, largest first (--asc: smallest first); one of {', '.join(SORTABLE)}, "
            "or an installed plugin's column (`headatlas metrics` lists them)."
        ),
    ),
    asc: bool = typer.Option(False, "--asc", help="Sort smallest first."),
    top: int | None = typer.Option(None, "--top", "-n", min=1, help="Show only the first N heads."),
    ci: bool = CiOpt,
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Per head: within-sentence share, repetition, distances, noise, attention targets, anchors,
    each against its chance. A table shows the main columns (--columns picks, --wide shows all;
    `headatlas metrics` defines each); --format json/csv has all."""
    from headatlas.service.reports import queries, query_support
    from headatlas.service.reports.columns import head_table

    table = head_table(terminal=True, sort=sort)
    view = TableView.of(columns, wide)
    _query(
        (db, at),
        run,
        fmt,
        queries.heads,
        "heads",
        table_columns=table,
        note=query_support.LIFT_NOTE,
        view=view,
        pinned=3 if sort is not None else 2,
        layer=layer,
        sort=sort,
        top=top,
        ci=ci,
        ascending=asc,
        shown=view.picked or (),  # a picked column the run holds no value of is refused, not shown blank
    )


def query_distances(
    layer: int = typer.Option(..., "--layer", "-l", help="Layer (0-based)."),
    head: int | None = typer.Option(None, "--head", help="Head (0-based); default: the layer's heads pooled."),
    run: str | None = RunOpt,
    max_distance: int | None = typer.Option(None, "--max-distance", help="Show distances up to this one."),
    split: str | None = typer.Option(
        None, "--split", help="attended: also the profiles of attended (signal) and not-attended (noise) pairs."
    ),
    ci: bool = CiOpt,
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Token distance distribution of the high-similarity pairs against chance, with a sparkline."""
    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.runs import ask
    from headatlas.service.reports import distance_queries

    if max_distance is not None and max_distance < 1:
        raise ParameterError(f"--max-distance {max_distance}: pass a distance of 1 or more")
    if split not in (None, "attended"):
        raise ParameterError(f"--split {split!r}: the only split is 'attended' (signal vs noise pairs)")
    unreliable: list[str] = []
    answer = ask(
        _store(db, at),
        run,
        distance_queries.distances,
        ci=ci,
        events=_said(unreliable),
        layer=layer,
        head=head,
        split=split is not None,
    )
    r, names, rows = answer.run, answer.columns, answer.rows
    if max_distance:
        rows = [row for row in rows if row[0] <= max_distance]
    what = f"layer {layer}" + (f" head {head}" if head is not None else " (all heads)")
    render_metrics(
        names,
        rows,
        fmt,
        title=f"run {r.run_id}: distances, {what}",
        note="lift = share of the head's high-similarity pairs at d / share of all pairs at d (chance)",
        view=TableView.of(columns, wide),
    )
    if fmt == Format.table and rows:
        col = {c: i for i, c in enumerate(names)}
        lines = [("high", "share"), ("chance", "chance_share")]
        if split:
            lines += [("signal", "attended_share"), ("noise", "noise_share")]
        series = {label: [row[col[c]] for row in rows] for label, c in lines}
        top = max((v or 0) for values in series.values() for v in values) if rows else 0
        for label, values in series.items():
            stdout.print(f"{label:<7}{sparkline(values, top=top)}", markup=False)
        stdout.print(f"       d=1{' ' * max(0, len(rows) - 8)}d={rows[-1][0]}")
    _print_warnings(unreliable)


def query_boundaries(
    run: str | None = RunOpt,
    ci: bool = CiOpt,
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Per layer: within-sentence share of high-similarity pairs vs chance (plain and matched to
    distance), attention to separators vs uniform. A table shows the main columns (--columns
    picks, --wide shows all); --format json/csv has all."""
    from headatlas.service.reports import layer_queries, query_support

    _query(
        (db, at),
        run,
        fmt,
        layer_queries.boundaries,
        "sentence boundaries per layer",
        table_columns=BOUNDARY_TABLE,
        note=query_support.LIFT_NOTE,
        view=TableView.of(columns, wide),
        ci=ci,
    )


def query_layers(
    run: str | None = RunOpt,
    ci: bool = CiOpt,
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Per layer summary: the progression from early to final layers. A table shows the main
    columns (--columns picks, --wide shows all); --format json/csv has all."""
    from headatlas.service.reports import layer_queries, query_support

    _query(
        (db, at),
        run,
        fmt,
        layer_queries.layers,
        "layers",
        table_columns=LAYER_TABLE,
        note=query_support.LIFT_NOTE,
        view=TableView.of(columns, wide),
        ci=ci,
    )


def query_mixing(
    run: str | None = RunOpt,
    layer: int | None = typer.Option(
        None, "--layer", "-l", help="Show this layer's heads (0-based); default: one row set per layer."
    ),
    methods: list[str] = typer.Option(
        [], "--method", help="attention, attribution, rollout, norm or alti (repeat); default: all stored."
    ),
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Where each output's mixture comes from: mass to self / neighbours / specials / punctuation and mean distance, per method."""
    from headatlas.service.reports import mixing_queries

    what = f"layer {layer} heads" if layer is not None else "per layer"
    _query(
        (db, at),
        run,
        fmt,
        mixing_queries.mixing,
        f"mixing, {what}",
        view=TableView.of(columns, wide),
        layer=layer,
        methods=methods or None,
    )


def query_discrepancy(
    run: str | None = RunOpt,
    method: str = typer.Option(
        "attribution", "--method", help="Compare attention with this method (default attribution)."
    ),
    top: int | None = typer.Option(None, "--top", "-n", min=1, help="Show only the first N heads."),
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Per head: Jensen-Shannon divergence (bits) between attention and attribution rows, ranked; then per layer."""
    from headatlas.service.reports import mixing_queries

    store = _store(db, at)
    with store.checked_read() as conn:
        r = _run(conn, run)
        names, rows = mixing_queries.discrepancy(conn, r.run_id, method=method, top=top)
        layer_cols, layer_rows = mixing_queries.discrepancy_layers(conn, r.run_id, method=method)
    view = TableView.of(columns, wide)
    title = f"run {r.run_id} ({r.name}): attention vs {method}, per head"
    render(names, rows, fmt, title=title, view=view if view.picked or view.wide else None)
    if fmt == Format.table:
        render(layer_cols, layer_rows, fmt, title="layer progression")


EXAMPLE_TABLE = ["layer", "head", "kind", "rank", "score", "value", "context"]


def query_examples(
    run: str | None = RunOpt,
    layer: int | None = typer.Option(None, "--layer", "-l", help="Only this layer (0-based)."),
    head: int | None = typer.Option(None, "--head", help="Only this head (0-based, needs --layer)."),
    kind: str | None = typer.Option(None, "--kind", help="anchor, pair or attention; default: all three."),
    limit: int | None = typer.Option(
        None, "--limit", "-n", min=1, help="The first N of each head and kind; default: every one kept."
    ),
    context: int = typer.Option(8, "--context", min=0, help="Tokens of text either side of an example's tokens."),
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Each head's top examples: the windows where its anchor, its most similar pair and its
    strongest attention are strongest (kept by analyze, --examples N per head and kind), with the
    text around them, the example's tokens in [brackets]. A table shows the main columns; --format
    json/csv has every one (token positions, window, document)."""
    from headatlas.service.reports import examples

    what = (
        "top examples"
        + (f", layer {layer}" if layer is not None else "")
        + (f" head {head}" if head is not None else "")
    )
    _query(
        (db, at),
        run,
        fmt,
        examples.examples,
        what,
        table_columns=EXAMPLE_TABLE,
        note=examples.NOTE,
        view=TableView.of(columns, wide),
        pinned=4,
        layer=layer,
        head=head,
        kind=kind,
        limit=limit,
        context=context,
    )


def _query(
    db: str | tuple[str, int | None],
    run: str | None,
    fmt: Format,
    query,
    title: str,
    table_columns=None,
    note: str | None = None,
    view: TableView = TableView(),
    pinned: int = 1,
    **kwargs,
) -> None:
    """Ask the run one question (service/operations/runs.py ``ask``: the run resolved, ``layer``
    and ``head`` checked against it) and render its rows (``view``, ``pinned``: see
    ``render_metrics``), then its warnings."""
    from headatlas.service.operations.runs import ask
    from headatlas.service.reports.intervals import scheme_of

    where, at = db if isinstance(db, tuple) else (db, None)
    unreliable: list[str] = []
    answer = ask(_store(where, at), run, query, events=_said(unreliable), **kwargs)
    r = answer.run
    table_columns, note = _with_effects(answer, table_columns, note)
    render_metrics(
        answer.columns,
        answer.rows,
        fmt,
        title=f"run {r.run_id} ({r.name}): {title}",
        table_columns=table_columns,
        note=note,
        schemes=[scheme_of(r.params)],
        view=view,
        pinned=pinned,
        groups=None if answer.groups is None else [answer.groups],
    )
    _print_warnings(unreliable)


def _with_effects(answer, table_columns, note):
    """A run with causal effects (SPEC §9): its main effect column joins the table's default
    columns, and the note says what the effects are measured against."""
    held = answer.effects
    if not held:
        return table_columns, note
    main = next(c for c in ("effect_mean", "effect_zero", "importance", *held) if c in held)
    shown = [main, *(["effect_streaming"] if "effect_streaming" in held else [])]
    if table_columns is not None:
        table_columns = [*table_columns, *(c for c in dict.fromkeys(shown) if c not in table_columns)]
    said = answer.effects_note
    return table_columns, (f"{note}\n{said}" if note and said else note or said)


def _interval_warnings(conn, *runs) -> list[str]:
    """Each run's warning that its intervals rest on too few replicate groups (SPEC §5d)."""
    from headatlas.service.operations.runs import interval_warnings

    return interval_warnings(conn, *runs)


def _said(warnings: list[str]):
    """The sink of a question: notes about its run at once, its warnings kept for under its table."""
    from headatlas.service.operations.events import ResultWarning

    def sink(event) -> None:
        if isinstance(event, ResultWarning):
            warnings.append(event.text)
        else:
            run_commands.notes(event)

    return sink


def _print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        said(f"warning: {warning}")


_run = run_commands.resolve  # the run a command names, or the default one, with a note when unfinished
