"""Training series: `train-toy` (the toy induction series), `query phases` and `plot trend`
(`query trend --series` lives with `query trend`, cli/schedule_commands.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer

from headatlas.cli import options
from headatlas.cli.console import stderr, stdout
from headatlas.cli.formats import Format
from headatlas.cli.messages import command_name
from headatlas.cli.metric_tables import render_metrics

DbOpt, FormatOpt = options.Db, options.Fmt
SeriesOpt = typer.Option(..., "--series", help="Training series name (analyze --checkpoints … --name NAME).")
LayerOpt = typer.Option(None, "--layer", "-l", help="One layer (0-based); default: every layer.")


def register(app: typer.Typer, query_app: typer.Typer, plot_app: typer.Typer) -> None:
    app.command("train-toy")(train_toy)
    query_app.command("phases")(query_phases)
    plot_app.command("trend")(plot_trend)


def train_toy(
    out: Path = typer.Argument(..., help="New folder for the checkpoints (step-NNNNNN/) and corpus.txt."),
    steps: int = typer.Option(1500, "--steps", min=1, help="Training steps (the phase change comes near 1,000)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and of the training data."),
    checkpoints: int = typer.Option(12, "--checkpoints", min=2, help="Checkpoints saved, log-spaced from step 0."),
    at: str = typer.Option(
        "",
        "--at",
        metavar="STEP,…",
        help="Steps saved besides the log-spaced ones (e.g. 900,1000,1100 near the phase change).",
    ),
) -> None:
    """Train the toy induction model: a 2-layer attention-only Llama (MLPs zeroed and frozen, a
    word-level tokenizer saved with it) on random token sequences whose second half repeats the
    first, saving log-spaced checkpoints. Its previous-token head (layer 0) and induction head
    (layer 1) form in a phase change: analyse them with the command printed at the end."""
    import time

    import torch

    from headatlas.service.training.toy import ToySpec
    from headatlas.service.training.toy import train_toy as train

    torch.set_num_threads(1)  # a tiny model: a second thread costs more in contention than it saves
    started = time.monotonic()

    def said(step: int, loss: float) -> None:
        shown = "" if loss != loss else f", loss {loss:.3f}"  # NaN before the first step
        stderr.print(f"step {step}{shown} ({time.monotonic() - started:.0f} s)")

    from headatlas.service.errors import Param, ParameterError

    try:
        extra = tuple(int(s) for s in at.split(",") if s.strip())
    except ValueError:
        raise ParameterError(Param("at", at), ": pass whole steps separated by commas, e.g. 900,1000,1100") from None
    spec = ToySpec(steps=steps, seed=seed, checkpoints=checkpoints, extra=extra)
    saved = train(out, spec, progress=said)
    stdout.print(f"wrote {len(saved)} checkpoints and corpus.txt under {out}")
    name = command_name()
    folder = shlex.quote(str(out))
    stdout.print(
        f"next: {name} analyze {folder}/corpus.txt --checkpoints {folder} --name toy --probe "
        f"--probe-length {spec.max_copy}",
        markup=False,
        highlight=False,
    )
    stdout.print(f"      {name} plot trend --series toy --out toy-trend.png", markup=False, highlight=False)


def query_phases(
    series: str = SeriesOpt,
    metric: list[str] = typer.Option(
        None,
        "--metric",
        help="A head column or probe score (repeatable); default: prev_token_score, induction_score, "
        "attn_to_prev, attn_induction.",
    ),
    layer: int | None = LayerOpt,
    head: int | None = typer.Option(None, "--head", help="One head of --layer (0-based)."),
    min_change: float | None = typer.Option(
        None,
        "--min-change",
        min=0.0,
        help="Leave out changes smaller than this; default 0, and 0.05 for a probe score (which has no interval).",
    ),
    db: str = DbOpt,
    fmt: Format = FormatOpt,
) -> None:
    """Phase changes of a training series: for each head and metric, the two consecutive checkpoints
    between which it changes most beyond both their 95% intervals, and the heads that change with it."""
    from headatlas.service.reports.series_queries import PHASE_METRICS, phase_rows, phases
    from headatlas.service.storage.store import Store

    with Store(db).checked_read() as conn:
        found = phases(
            conn, series, metrics=tuple(metric or PHASE_METRICS), layer=layer, head=head, min_change=min_change
        )
    columns, rows = phase_rows(found)
    render_metrics(
        columns,
        rows,
        fmt,
        title=f"series {series}: phase changes (0-based layers and heads)",
        note="beyond: the two checkpoints' 95% intervals do not overlap (none: a probe score, which has no "
        "interval); together: heads whose change of the same metric ends at the same step",
    )


def plot_trend(
    series: str = SeriesOpt,
    metric: list[str] = typer.Option(
        None,
        "--metric",
        help="A head column or probe score (repeatable): one panel each; default: "
        "prev_token_score and induction_score.",
    ),
    layer: int | None = LayerOpt,
    linear: bool = typer.Option(
        False, "--linear", help="A linear step axis (default: logarithmic past step 1, step 0 included)."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Output file: .png or .svg."),
    db: str = DbOpt,
    dpi: int = typer.Option(100, "--dpi", help="Pixels per inch of a PNG (the figure size in inches is fixed)."),
) -> None:
    """A training series' metrics against the step: a line per head, 95% intervals as bands, the
    phase change marked."""
    from headatlas.cli.visual import _wrote
    from headatlas.service.reports import plots
    from headatlas.service.reports.series_plots import figure_trend
    from headatlas.service.storage.store import Store

    plots.output_format(out)
    with Store(db).checked_read() as conn:
        fig = figure_trend(
            conn, series, tuple(metric or ("prev_token_score", "induction_score")), layer=layer, linear=linear
        )
    _wrote(plots.save(fig, out, dpi=dpi), fig, dpi)
