"""Recurring analyses: `schedule …`, `beat` and `query trend` (registered on the main app)."""

from __future__ import annotations

import logging

import typer

from headatlas.cli import options
from headatlas.cli.console import stdout
from headatlas.cli.formats import DEFAULT_VIEW, Format, TableView, render, render_record
from headatlas.cli.metric_tables import render_metrics
from headatlas.cli.sparklines import trend_line
from headatlas.service.analysis_options import BY_NAME, DEFAULTS
from headatlas.service.config import Settings

DbOpt, BrokerOpt, FormatOpt = options.Db, options.Broker, options.Fmt
NameArg = typer.Argument(..., help="Schedule name.")

schedule_app = typer.Typer(help="Recurring analyses: schedules fired by `headatlas beat`.", no_args_is_help=True)


def register(app: typer.Typer, query_app: typer.Typer) -> None:
    app.add_typer(schedule_app, name="schedule")
    app.command()(beat)
    query_app.command("trend")(query_trend)


def _settings(db: str, broker: str | None = None) -> Settings:
    from headatlas.cli.queue_commands import _settings as export

    return export(db=db, broker_url=broker)


def _show(sched) -> list[tuple]:
    return [
        (
            sched.name,
            "on" if sched.enabled else "paused",
            sched.cadence.describe(),
            "yes" if sched.only_new else "no",
            sched.model,
            sched.corpus,
            sched.last_fire,
            sched.next_fire,
        )
    ]


SHOW_COLUMNS = ["name", "state", "when", "only_new", "model", "corpus", "last_fire_utc", "next_fire_utc"]
# what a table shows by default, fitted to 100 columns (its corpus path and only_new: --wide or --columns)
LIST_TABLE = ["name", "state", "when", "next_fire_utc", "last_fire_utc", "model", "only_new", "corpus"]
FIRE_TABLE = ["fire_time", "fire_status", "documents", "run_id", "run_status", "error", "kind", "run"]


def _render_one(sched, fmt: Format, view: TableView = DEFAULT_VIEW, **more) -> None:
    """One schedule: a one-row table or CSV, or one JSON object (with ``more`` fields, e.g. its fires)."""
    if fmt == Format.json:
        render_record(dict(zip(SHOW_COLUMNS, _show(sched)[0]), **more), fmt)
    else:
        _render_schedules(_show(sched), fmt, view)


def _render_schedules(rows: list[tuple], fmt: Format, view: TableView) -> None:
    """Schedules as rows: a table shows LIST_TABLE fitted to the width, CSV and JSON every column."""
    render(SHOW_COLUMNS, rows, fmt, view=view, table_columns=LIST_TABLE)


@schedule_app.command("add")
@options.analysis_options(exclude=("device", "text_field", "encoding", "probe", "probe_length", "probe_sequences"))
def schedule_add(
    name: str = NameArg,
    *,
    corpus: str = typer.Option(
        ..., "--corpus", help="A .txt/.jsonl/.csv file, a directory or a glob (read by beat at each fire)."
    ),
    cron: str | None = typer.Option(None, "--cron", help='Cron expression in --timezone, e.g. "0 3 * * *".'),
    every: str | None = typer.Option(None, "--every", help="Interval instead of --cron: 45s, 30m, 6h, 1d."),
    timezone: str = typer.Option("UTC", "--timezone", help="IANA time zone of the cron expression."),
    only_new: bool = typer.Option(
        False, "--only-new", help="Each fire analyses only documents no earlier fire of this schedule sent."
    ),
    analysis: options.AnalysisOptions,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
) -> None:
    """Add a schedule: analyse CORPUS with MODEL on a cron expression or an interval."""
    from headatlas.service.operations.requests import QueuedAnalysis
    from headatlas.service.operations.submission import ScheduleRequest, add_schedule

    request = ScheduleRequest(
        name,
        QueuedAnalysis.build(corpus, **analysis.values),
        cron=cron,
        every=every,
        timezone=timezone,
        only_new=only_new,
    )
    _render_one(add_schedule(request, db), fmt)


@schedule_app.command("edit")
def schedule_edit(
    name: str = NameArg,
    corpus: str | None = typer.Option(None, "--corpus", help="New corpus."),
    cron: str | None = typer.Option(None, "--cron", help="New cron expression (replaces an interval)."),
    every: str | None = typer.Option(None, "--every", help="New interval (replaces a cron expression)."),
    timezone: str | None = typer.Option(None, "--timezone", help="New time zone."),
    model: str | None = options.declared_option(BY_NAME["model"], help="New model spec, as for add.", default=None),
    only_new: bool | None = typer.Option(None, "--only-new/--all", help="Analyse only new documents, or all."),
    db: str = DbOpt,
    fmt: Format = FormatOpt,
) -> None:
    """Change a schedule; a running beat uses the change at its next tick."""
    from headatlas.service.engine.model_check import check_model_spec
    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.submission import schedule_corpus
    from headatlas.service.schedules import check_cron, check_timezone, parse_every
    from headatlas.service.storage import schedule_store

    if cron is not None and every is not None:
        raise ParameterError("give one of --cron EXPR or --every INTERVAL, not both")
    if timezone is not None:
        check_timezone(timezone)
    if model is not None:
        with schedule_store.read(db) as conn:
            seq_len = schedule_store.get(conn, name).params.get("seq_len", DEFAULTS["seq_len"])
        check_model_spec(model, seq_len=seq_len, memory="total")
    sched = schedule_store.edit(
        db,
        name,
        corpus=schedule_corpus(corpus) if corpus is not None else None,
        model=model,
        only_new=only_new,
        cron=check_cron(cron) if cron is not None else None,
        every_s=parse_every(every) if every is not None else None,
        timezone=timezone,
    )
    _render_one(sched, fmt)


@schedule_app.command("list")
def schedule_list(
    columns: str | None = options.Columns, wide: bool = options.Wide, db: str = DbOpt, fmt: Format = FormatOpt
) -> None:
    """List the schedules: cadence, state, next and last fire (UTC), model; the corpus in --wide."""
    from headatlas.service.storage import schedule_store

    with schedule_store.read(db) as conn:
        rows = [row for s in schedule_store.all_schedules(conn) for row in _show(s)]
    _render_schedules(rows, fmt, TableView.of(columns, wide))


@schedule_app.command("show")
def schedule_show(
    name: str = NameArg,
    columns: str | None = options.Columns,
    wide: bool = options.Wide,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
) -> None:
    """A schedule and its fires, the newest first, each with its run (id, name, status)."""
    from headatlas.service.storage import schedule_store

    with schedule_store.read(db) as conn:
        sched = schedule_store.get(conn, name)
        names, rows = schedule_store.fires(conn, sched.schedule_id)
    if fmt == Format.table:  # --columns and --wide: the fires' columns
        view = TableView.of(columns, wide) if columns is not None or wide else DEFAULT_VIEW
        _render_schedules(_show(sched), fmt, TableView(wide=wide))
        render(
            names,
            rows,
            fmt,
            title=f"schedule {name}: fires (UTC), the newest first",
            view=view,
            table_columns=FIRE_TABLE,
        )
    elif fmt == Format.json:
        _render_one(sched, fmt, fires=[dict(zip(names, row)) for row in rows])
    else:  # csv: the fires, one per row (a schedule's fields are in `schedule list --format csv`)
        render(names, rows, fmt, view=TableView.of(columns, wide))


@schedule_app.command("pause")
def schedule_pause(name: str = NameArg, db: str = DbOpt) -> None:
    """Stop firing a schedule (its runs and record stay)."""
    from headatlas.service.storage import schedule_store

    schedule_store.set_enabled(db, name, False)
    stdout.print(f"schedule {name} paused")


@schedule_app.command("resume")
def schedule_resume(name: str = NameArg, db: str = DbOpt) -> None:
    """Fire a paused schedule again, from its next scheduled time (missed fires are not caught up)."""
    from headatlas.service.storage import schedule_store

    sched = schedule_store.set_enabled(db, name, True)
    stdout.print(f"schedule {name} resumed; next fire {sched.next_fire} UTC")


@schedule_app.command("remove")
def schedule_remove(name: str = NameArg, db: str = DbOpt) -> None:
    """Delete a schedule and its record of fires; the runs it created stay."""
    from headatlas.service.storage import schedule_store

    schedule_store.remove(db, name)
    stdout.print(f"schedule {name} removed (its runs are kept)")


@schedule_app.command("run-now")
def schedule_run_now(name: str = NameArg, db: str = DbOpt, broker: str = BrokerOpt) -> None:
    """Fire a schedule once now (paused or not), without changing its next fire; prints the run name."""
    from headatlas.service.errors import HeadatlasError
    from headatlas.service.storage import schedule_store
    from headatlas.service.storage.schedule_store import now
    from headatlas.workers.beat import fire
    from headatlas.workers.ledger import connect

    settings = _settings(db, broker)
    connect(settings.broker_url)
    with schedule_store.read(db) as conn:
        sched = schedule_store.get(conn, name)
    result = fire(settings, sched, now().replace(microsecond=0), kind="manual")
    if result.status == "in_hand":
        raise HeadatlasError(f"schedule {name} has a fire being submitted by a beat: try again when it is done")
    if not result.claimed:
        raise HeadatlasError(f"schedule {name} was fired this very second already: try again")
    if result.resumed:
        stdout.print(f"schedule {name}: submitted a fire a stopped beat had left, not a new one", markup=False)
    if result.status == "error":
        raise HeadatlasError(str(result.error))
    if result.status == "no_new_documents":
        stdout.print(f"schedule {name}: no new document to analyse")
        return
    stdout.print(result.run_name)


def beat(
    db: str = DbOpt,
    broker: str = BrokerOpt,
    tick: float = typer.Option(1.0, "--tick", min=0.1, help="Seconds between two reads of the schedules."),
    loglevel: str = options.Loglevel,
) -> None:
    """Fire due schedules: submit their runs to the queue (run one; a second one creates no duplicate run)."""
    from headatlas.workers.beat import Beat
    from headatlas.workers.launch import stacks_on_sigusr1

    stacks_on_sigusr1()
    settings = _settings(db, broker)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("headatlas").setLevel(loglevel.upper())
    Beat(settings, tick_s=tick).run()


def query_trend(
    schedule: str | None = typer.Option(None, "--schedule", help="Schedule name: its runs in fire order."),
    series: str | None = typer.Option(
        None,
        "--series",
        help="Training series name (analyze --checkpoints): every head's metric against the training step.",
    ),
    metric: str = typer.Option(
        "within_sentence",
        "--metric",
        help="within_sentence, repetition, mean_distance, noise_share, …; with --series also a head column or a "
        "probe score (prev_token_score, induction_score, duplicate_score).",
    ),
    layer: int | None = typer.Option(
        None, "--layer", "-l", help="One layer (0-based); default: the mean over layers (--series: every layer)."
    ),
    head: int | None = typer.Option(None, "--head", help="One head of --layer (0-based)."),
    ci: bool = options.Ci,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
) -> None:
    """A metric across a schedule's runs over time, or across a training series' checkpoints by step."""
    from headatlas.service.errors import Param, ParameterError
    from headatlas.service.reports import query_support, trend_queries

    if (schedule is None) == (series is None):
        raise ParameterError("query trend: pass ", Param("schedule"), " or ", Param("series"), ", one of them")
    what = (
        f"layer {layer} head {head}"
        if head is not None
        else f"layer {layer}"
        if layer is not None
        else "every head"
        if series is not None
        else "mean over layers"
    )
    note = query_support.LIFT_NOTE if "lift" in metric else None
    if series is not None:
        from headatlas.service.reports.series_queries import trend as series_trend
        from headatlas.service.storage.store import Store

        with Store(db).checked_read() as conn:
            columns, rows = series_trend(conn, series, metric=metric, layer=layer, head=head, ci=ci)
        render_metrics(columns, rows, fmt, title=f"series {series}: {metric} by step, {what} (0-based)", note=note)
        return
    from headatlas.service.storage import schedule_store

    assert schedule is not None  # one of the two, checked above
    with schedule_store.read(db) as conn:
        sched = schedule_store.get(conn, schedule)
        columns, rows = trend_queries.trend(conn, sched.schedule_id, metric=metric, layer=layer, head=head, ci=ci)
    render_metrics(columns, rows, fmt, title=f"schedule {schedule}: {metric}, {what}", note=note)
    if fmt == Format.table and rows:
        stdout.print(trend_line(metric, [r[columns.index(metric)] for r in rows]))
