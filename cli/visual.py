"""Commands that draw and ship results: inspect, plot, report, export.

Registered on the main app by ``register(app)``. Thin like the rest of the CLI: parse options,
call one library function, say what was written. matplotlib is imported only when a figure is
drawn, so other commands start as fast as before.
"""

from __future__ import annotations

import sys
from enum import Enum
from pathlib import Path

import typer

from headatlas.cli import options
from headatlas.cli.console import stderr, stdout

plot_app = typer.Typer(
    help="Figures of a stored run, as PNG or SVG (by the --out suffix). Layers and heads are 0-based.",
    no_args_is_help=True,
)

DbOpt, RunOpt = options.Db, options.Run
RunArg = typer.Argument(None, help="Run id, name or alias (default: the latest finished run, controls aside).")
FigureOut = typer.Option(..., "--out", "-o", help="Output file: .png or .svg.")
DpiOpt = typer.Option(100, "--dpi", help="Pixels per inch of a PNG (the figure size in inches is fixed).")


class Matrix(str, Enum):
    csm = "csm"
    attention = "attention"


class ExportFormat(str, Enum):
    parquet = "parquet"
    csv = "csv"


def register(app: typer.Typer) -> None:
    app.command()(inspect)
    app.add_typer(plot_app, name="plot")
    app.command()(report)
    app.command()(export)


# --- inspect ----------------------------------------------------------------------------------
@options.analysis_options(
    "model",
    "device",
    "seq_len",
    "select",
    "sentences",
    "vectors",
    "include_special",
    "text_field",
    "encoding",
    help={
        "text_field": "JSONL field / CSV column holding the text (with --file).",
        "encoding": "Text encoding of --file.",
    },
)
def inspect(
    text: str | None = typer.Argument(None, help="The text to look at, or - to read it from stdin."),
    *,
    file: Path | None = typer.Option(
        None, "--file", help="Read the text from a .txt/.jsonl/.csv file (its first document)."
    ),
    out: Path = FigureOut,
    layer: int | None = typer.Option(
        None, "--layer", "-l", help="Layer (0-based); alone: a grid of that layer's heads."
    ),
    head: int | None = typer.Option(
        None, "--head", help="Head (0-based, needs --layer): its CSM and attention map side by side."
    ),
    matrix: Matrix = typer.Option(Matrix.csm, "--matrix", help="What the grid shows when no --head is given."),
    analysis: options.AnalysisOptions,
    dpi: int = DpiOpt,
) -> None:
    """One text, no database: a head's similarity matrix and attention map, or a grid of heads.

    With --layer and --head: the context similarity matrix (C = z zᵀ, C_ii = 0, high-similarity
    pairs outlined) and the attention map side by side, tokens on the axes, sentence boundaries
    dashed. Without --head: a layer × head grid of small matrices (--matrix csm|attention).
    """
    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.inspection import inspect as inspect_text
    from headatlas.service.operations.requests import InspectionRequest

    if (text is None) == (file is None):
        raise ParameterError('inspect: pass the text as an argument ("…" or - for stdin) or --file FILE, not both')
    from headatlas.service.reports.plots import output_format

    output_format(out)  # refuse a bad suffix before loading the model
    request = InspectionRequest.build(
        sys.stdin.read() if text == "-" else text, file=file, layer=layer, head=head, **analysis.values
    )
    result = inspect_text(request)
    from headatlas.service.reports import matrix_plots, plots

    if head is not None and layer is not None:  # --head without --layer was refused above
        fig = matrix_plots.figure_head(result, layer, head)
    else:
        fig = matrix_plots.figure_grid(result, layer=layer, matrix=matrix.value)
    path = plots.save(fig, out, dpi=dpi)
    if result.truncated:
        stderr.print(
            f"note: the text is longer than one window; showing its first {len(result.tokens)} tokens (--seq-len)"
        )
    _wrote(path, fig, dpi)


# --- plot -------------------------------------------------------------------------------------
def _plot(kind: str, run: str | None, db: str, out: Path, dpi: int, **options) -> None:
    from headatlas.service.reports import plots

    _draw(db, out, dpi, lambda conn, resolve: plots.run_figure(kind, conn, resolve(run), **options))


def _draw(db: str, out: Path, dpi: int, figure) -> None:
    """Check --out, draw ``figure(conn, resolve_run)`` from one read of the database, write it."""
    from functools import partial

    from headatlas.cli.run_commands import resolve
    from headatlas.service.reports import plots
    from headatlas.service.storage.store import Store

    plots.output_format(out)
    with Store(db).checked_read() as conn:
        fig = figure(conn, partial(resolve, conn))
    _wrote(plots.save(fig, out, dpi=dpi), fig, dpi)


@plot_app.command("distances")
def plot_distances(
    run: str | None = RunOpt,
    split: str | None = typer.Option(
        None,
        "--split",
        help="attended: the profiles of attended (signal) and not-attended (noise) pairs, each against chance.",
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Distance distribution of the high-similarity pairs per layer against the chance profile."""
    from headatlas.service.errors import ParameterError

    if split not in (None, "attended"):
        raise ParameterError(f"--split {split!r}: the only split is 'attended' (signal vs noise pairs)")
    _plot("distances", run, db, out, dpi, split=split)


@plot_app.command("boundaries")
def plot_boundaries(
    run: str | None = RunOpt,
    by_distance: bool = typer.Option(
        False,
        "--by-distance",
        help="The within-sentence share of the high-similarity pairs at each token distance, one line per layer, against the share of all pairs at that distance sharing a sentence.",
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Within-sentence share per layer against chance, best head per layer, attention to separators."""
    _plot("boundaries", run, db, out, dpi, by_distance=by_distance)


@plot_app.command("heads")
def plot_heads(
    run: str | None = RunOpt,
    metric: str = typer.Option(
        "within_sentence_lift",
        "--metric",
        help="Any numeric column of `headatlas query heads` (e.g. repetition_lift, mean_distance, noise_share, attn_to_punct).",
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Layer × head heatmap of one metric; lifts are centred on 1 (chance)."""
    from headatlas.service.reports import queries
    from headatlas.service.reports.columns import unknown_metric

    if metric not in queries.SORTABLE:
        raise unknown_metric("metric", metric, queries.SORTABLE)
    _plot("heads", run, db, out, dpi, metric=metric)


@plot_app.command("layers")
def plot_layers(run: str | None = RunOpt, out: Path = FigureOut, db: str = DbOpt, dpi: int = DpiOpt) -> None:
    """The layer progression: one small panel per measure of `headatlas query layers`."""
    _plot("layers", run, db, out, dpi)


@plot_app.command("csm")
def plot_csm(
    run: str | None = RunOpt,
    layer: int = typer.Option(..., "--layer", "-l", help="Layer (0-based); alone: a grid of that layer's heads."),
    head: int | None = typer.Option(
        None, "--head", help="Head (0-based): its mean similarity matrix and where its attended and noise pairs fall."
    ),
    kind: str = typer.Option(
        "all",
        "--kind",
        help="What the grid of heads shows: all (mean C), attended or noise (share of each cell's pairs).",
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Corpus-averaged context similarity matrices by token position (bins of --csm-bin positions)."""
    from headatlas.service.reports import csm_plots

    _draw(db, out, dpi, lambda conn, resolve: csm_plots.run_csm(conn, resolve(run), layer=layer, head=head, kind=kind))


@plot_app.command("mixing")
def plot_mixing(
    run: str | None = RunOpt,
    method: list[str] = typer.Option(
        [],
        "--method",
        help="attention, attribution, rollout, norm or alti (repeat; default: every method the run holds).",
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Per layer: mass to self, neighbours, specials and punctuation, one line per mixing method."""
    from headatlas.service.reports import mixing_plots

    _draw(db, out, dpi, lambda conn, resolve: mixing_plots.run_mixing(conn, resolve(run), methods=method or None))


@plot_app.command("discrepancy")
def plot_discrepancy(
    run: str | None = RunOpt,
    method: str = typer.Option(
        "attribution", "--method", help="The method set against attention: attribution, rollout, norm or alti."
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Per-head Jensen–Shannon divergence between attention and a mixing method, and its layer progression."""
    from headatlas.service.reports import mixing_plots

    _draw(db, out, dpi, lambda conn, resolve: mixing_plots.run_discrepancy(conn, resolve(run), method=method)[0])


@plot_app.command("atlas")
def plot_atlas(
    run: str | None = RunOpt,
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
    colour: str | None = typer.Option(
        None,
        "--colour",
        metavar="METRIC",
        help="What colours the cells (default: the strongest evidence the run holds: effect_mean, else effect_zero "
        "(what removing the head costs, SPEC §9), else 'evidence': the primary role's value over its threshold). "
        "'role': each primary role its own colour; or any head metric, such as effect_streaming (what its KV head "
        "streaming costs, SPEC §10: effects RUN --streaming). The roles stay written in the cells; an "
        "unsure cell is drawn faded.",
    ),
) -> None:
    """The head atlas: layer × head grid, each head's primary role named (rules: SPEC §7), coloured by its evidence."""
    from headatlas.service.reports import atlas_plots

    _draw(db, out, dpi, lambda conn, resolve: atlas_plots.run_atlas(conn, resolve(run), colour=colour)[0])


@plot_app.command("compare")
def plot_compare(
    run_a: str = typer.Argument(..., help="Run A: id or name."),
    run_b: str | None = typer.Argument(None, help="Run B: id or name (default: run A's random-weights control)."),
    metric: list[str] = typer.Option(
        [], "--metric", "-M", help="A metric of `query layers` (repeat); default: the main lifts and shares."
    ),
    heat_metric: str | None = typer.Option(
        None,
        "--heat-metric",
        help="Metric of the per-head A − B heat map (default: the first --metric); runs of one shape only.",
    ),
    out: Path = FigureOut,
    db: str = DbOpt,
    dpi: int = DpiOpt,
) -> None:
    """Two runs' layer profiles with 95% intervals, one panel per metric, and a per-head difference heat map."""
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import atlas_plots, compare

    def figure(conn, resolve):
        a = resolve(run_a)
        b = resolve(run_b) if run_b is not None else compare.control_of(conn, a)
        if b is None:
            raise ParameterError(
                f"plot compare {run_a}: run {a.run_id} ({a.name}) has no control run; pass RUN_B, "
                "or analyse again with --control"
            )
        return atlas_plots.run_compare(conn, a, b, metrics=metric or None, heat_metric=heat_metric)

    _draw(db, out, dpi, figure)


# --- report and export ------------------------------------------------------------------------
def report(
    run: str | None = RunArg,
    out: Path = typer.Option(
        Path("report.html"), "--out", "-o", help="Output HTML file (self-contained); a folder gets report.html in it."
    ),
    db: str = DbOpt,
    at: int | None = options.At,
) -> None:
    """One self-contained HTML page about a run: parameters, figures, head table, top anchors (on a lake: as of one
    snapshot, named on the page; `--at` it gives the same numbers later)."""
    from headatlas.cli.run_commands import resolve
    from headatlas.service.reports.report import write_report
    from headatlas.service.storage.store import Store

    store = Store(db, at=at)
    with store.checked_read() as conn:
        r = resolve(conn, run)
        snapshot = store.snapshot(conn)
        path = write_report(conn, r, out, snapshot=snapshot)
    where = f", snapshot {snapshot}" if snapshot is not None else ""
    stdout.print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KB): run {r.run_id} ({r.name}){where}")


def export(
    run: str | None = RunArg,
    fmt: ExportFormat = typer.Option(ExportFormat.parquet, "--format", "-f", help="parquet or csv."),
    out: Path = typer.Option(..., "--out", "-o", help="Output folder (created; files in it are replaced)."),
    db: str = DbOpt,
    at: int | None = options.At,
) -> None:
    """Every table of a run as Parquet or CSV files (one per table) plus manifest.json."""
    from headatlas.service.reports.export import export_run

    r, tables = export_run(db, run, fmt.value, out, at=at)
    for t in tables:
        stdout.print(f"{t.path}  {t.rows:,} rows")
    stdout.print(f"run {r.run_id} ({r.name}): {len(tables)} tables in {out} (manifest.json lists them)")


def _wrote(path: Path, fig, dpi: int) -> None:
    from headatlas.service.reports.plots import pixel_size

    if path.suffix.lower() == ".png":
        width, height = pixel_size(fig, dpi)
        stdout.print(f"wrote {path} ({width}×{height} px)")
    else:
        stdout.print(f"wrote {path}")
