"""The `headatlas` command line. Thin: parse options, open the store, call the library, render."""

from __future__ import annotations

import functools
import logging
import os
import shlex
import sys

import typer
from typer.core import TyperGroup

try:  # typer vendors its own click from 0.25 on; its usage errors are that click's
    from typer._click.exceptions import UsageError
except ImportError:  # pragma: no cover - older typer on the public click
    from click.exceptions import UsageError  # type: ignore[assignment]  # the same class, in click itself

from headatlas.cli import options, run_commands
from headatlas.cli.output import (
    Format,
    TableView,
    command_name,
    error,
    note,
    print_wrapped,
    progress_bar,
    render,
    render_metrics,
    sparkline,
    stderr,
    stdout,
)
from headatlas.service.config import Settings
from headatlas.service.errors import HeadatlasError
from headatlas.service.reports.columns import SORTABLE
from headatlas.service.storage import relations

INTERRUPTED = "interrupted; re-run the same command to resume"


class Commands(TyperGroup):
    """The one place where a user's mistake becomes one line on stderr and exit code 2.

    Domain errors (service.errors) and click's usage errors print ``error: …``; Ctrl-C prints the
    resume hint and exits 130. Everything else is a bug and keeps its traceback.
    """

    # options whose value may be left out (typer has no such option): the value they then take
    OPTIONAL_VALUES = {"--control": "1"}

    def parse_args(self, ctx, args):
        args = list(args)
        _take_data_path(args)
        for i in reversed(range(len(args))):
            if args[i] in self.OPTIONAL_VALUES and (i + 1 == len(args) or not args[i + 1].isdigit()):
                args.insert(i + 1, self.OPTIONAL_VALUES[args[i]])
        return super().parse_args(ctx, args)

    def main(self, *args, **kwargs):
        from headatlas.cli.help import plain_help

        plain_help(self)  # value names instead of types, help sentences unbroken
        return super().main(*args, **kwargs)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HeadatlasError as exc:
            error(str(exc))
            raise SystemExit(exc.exit_code) from None
        except UsageError as exc:
            if not exc.format_message():  # "no arguments: show the help" is not a mistake
                raise
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            error(f"{exc.format_message()} (see `{where} --help`)")
            raise SystemExit(exc.exit_code) from None
        except KeyboardInterrupt:
            error(INTERRUPTED)
            raise Interrupted(130) from None


class Interrupted(SystemExit):
    """Ctrl-C, said and handled: what was finished is stored and every file is closed."""


def _take_data_path(args: list[str]) -> None:
    """``--data-path DIR`` anywhere on the command line (before or after the command, as users
    write ``--db``): it names where the lakes this command opens keep their files, so it becomes
    HEADATLAS_DATA_PATH for the command and its children."""
    for i, arg in enumerate(args):
        if arg == "--":
            return
        if arg == "--data-path" and i + 1 < len(args):
            os.environ["HEADATLAS_DATA_PATH"] = args[i + 1]
            del args[i : i + 2]
            return
        if arg.startswith("--data-path="):
            os.environ["HEADATLAS_DATA_PATH"] = arg.split("=", 1)[1]
            del args[i]
            return


app = typer.Typer(
    cls=Commands,
    help="headatlas: what the attention heads of a transformer do, at corpus scale, stored and queryable.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion / --show-completion: bash, zsh, fish, PowerShell
    context_settings={"help_option_names": ["-h", "--help"]},
)
query_app = typer.Typer(help="Ask a stored run about its heads (layers and heads are 0-based).", no_args_is_help=True)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(query_app, name="query")
app.add_typer(db_app, name="db")
app.add_typer(run_commands.runs_app, name="runs")  # list, rename, delete, tag

DbOpt, RunOpt, FormatOpt, CiOpt, AtOpt = options.Db, options.Run, options.Fmt, options.Ci, options.At
ColumnsOpt, WideOpt = options.Columns, options.Wide


def _version(value: bool) -> None:
    if value:
        from headatlas import __version__

        stdout.print(f"headatlas {__version__}", markup=False, highlight=False)
        raise typer.Exit()


# what a table shows by default (JSON and CSV hold every column; --columns picks, --wide shows all):
# each set fits 100 characters on the shipped excerpt (a narrower table leaves columns out from the right)
HEAD_TABLE = [
    "layer",
    "head",
    "within_sentence_lift_dm",
    "repetition_words_lift_dm",
    "mean_distance",
    "noise_share",
]
LAYER_TABLE = [
    "layer",
    "mean_distance",
    "within_sentence_lift_dm",
    "repetition_words_lift_dm",
    "attn_to_cls_lift",
]


def _store(db: str, at: int | None = None):
    from headatlas.service.storage.store import Store

    return Store(db, at=at)


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
    data_path: str | None = typer.Option(
        None,
        "--data-path",
        envvar="HEADATLAS_DATA_PATH",
        help="Where a lake (--db ducklake:…) keeps its Parquet files: a folder or a shared mount, as this machine "
        "sees it; needed when a lake is created (it is recorded there), and on hosts that mount it elsewhere. "
        "Taken anywhere on the command line.",
    ),
) -> None:
    """headatlas: what the attention heads of a transformer do, at corpus scale, stored and queryable."""
    if data_path:
        os.environ["HEADATLAS_DATA_PATH"] = data_path  # every lake this command (and its children) opens


# --- analysis ---------------------------------------------------------------------------------
@app.command()
@options.analysis_options()
def analyze(
    corpus: str = typer.Argument(..., help="A .txt/.jsonl/.csv file, a directory, a glob, or - for stdin."),
    *,
    name: str | None = options.Name,
    analysis: options.AnalysisOptions,
    db: str = DbOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no summary."),
    attribution_chunk: int = options.setting(
        "attribution_chunk",
        "--attribution-chunk",
        min=1,
        help="Gradient rows per batched backward call: bounds memory.",
    ),
    control: int = typer.Option(
        0,
        "--control",
        min=0,
        metavar="[N]",
        help="Also analyse the same windows with N randomly initialised models of the same config and tokenizer "
        "(seeds 0..N-1; --control alone: N = 1), stored as <name>-control (seed 0) and <name>-control-K (seed K): "
        "the floor `headatlas compare RUN` and the role thresholds measure against (SPEC §7: the findings use 3).",
    ),
) -> None:
    """Analyse a corpus in this process and store the per-head statistics (resumable)."""
    _analyze(corpus, analysis, name=name, db=db, quiet=quiet, attribution_chunk=attribution_chunk, control=control)


@app.command()
@options.analysis_options("model", "device", "batch_size")
def demo(*, analysis: options.AnalysisOptions, db: str = DbOpt) -> None:
    """Analyse the shipped Wikipedia excerpt with the default model and show what the heads do."""
    from headatlas.service.engine.corpus import demo_corpus_path

    chunk = Settings.default("attribution_chunk")  # the demo computes no attribution
    _analyze(str(demo_corpus_path()), analysis, name="demo", db=db, quiet=False, attribution_chunk=chunk, control=0)


def _analyze(
    corpus: str,
    analysis: options.AnalysisOptions,
    *,
    name: str | None,
    db: str,
    quiet: bool,
    attribution_chunk: int,
    control: int,
) -> None:
    from headatlas.service.analysis_options import parse_batch_size
    from headatlas.service.engine.corpus import STDIN_SOURCE, remove_spool, spool_stdin
    from headatlas.service.engine.model import auto_batch_size, control_model, load_model, resolve_device
    from headatlas.service.engine.model_check import check_loaded, check_model_spec
    from headatlas.service.engine.runner import analyze_corpus, control_name, finished_run, survey_corpus
    from headatlas.service.storage.db import check_headatlas_file

    params, model, device = analysis.params, analysis.model, analysis.device
    text_field, encoding = analysis.text_field, analysis.encoding
    size = parse_batch_size(analysis.batch_size)
    probe = analysis.probe_spec
    # every check that needs no model weights comes before the corpus is read or a model loaded
    resolve_device(device)
    store_every_s = Settings.from_env().store_every_s
    check_headatlas_file(db)
    check_model_spec(model, seq_len=params.seq_len, device=device)
    spooled = spool_stdin() if corpus == "-" else None
    spec, label = (str(spooled), STDIN_SOURCE) if spooled else (corpus, None)
    try:
        summary = survey_corpus(spec, text_field=text_field, encoding=encoding, label=label)
        store = _store(db)
        done = (
            finished_run(store, summary.fingerprint, summary.distinct, model, params, name=name, probe=probe)
            if control == 0
            else None
        )
        if done is not None:  # found without loading the model's weights
            if quiet:
                stdout.print(done.run_id)
            else:
                note(f"run {done.run_id} ({done.name}) is complete: nothing to analyse")
                _print_run_summary(store, done.run_id)
            return
        if not quiet:
            dup = f" ({summary.duplicates} repeated, analysed once)" if summary.duplicates else ""
            stderr.print(
                f"corpus: {summary.documents} documents{dup}, {summary.chars:,} characters; loading model {model} …"
            )
        loaded = load_model(model, device=device, dtype=params.dtype)
        check_loaded(loaded, params.seq_len)
        size = size if isinstance(size, int) else auto_batch_size(loaded, params.seq_len)
        # the run and its control (--control) analyse the same windows the same way
        run_on = functools.partial(
            analyze_corpus,
            spec,
            store=store,
            params=params,
            corpus=summary,
            batch_size=size,
            text_field=text_field,
            encoding=encoding,
            label=label,
            attribution_chunk=attribution_chunk,
            flush_s=store_every_s,
            probe=probe,
            notice=None if quiet else (lambda text: stderr.print(text, markup=False, highlight=False)),
        )
        with _progress(summary.chars, quiet) as progress:
            run = run_on(model=loaded, name=name, progress=progress)
        if name is not None and run.name != name and not quiet:
            note(
                f"run {run.run_id} ({run.name}) holds this corpus, model and parameters already: reused, and "
                f"{name!r} now names it too (--run {shlex.quote(name)})"
            )
        floors = []
        for seed in range(control):
            if not quiet:
                stderr.print(
                    f"control {seed + 1}/{control}: the same windows through a randomly initialised "
                    f"{loaded.n_layers}×{loaded.n_heads} model (seed {seed}) …"
                )
            with _progress(summary.chars, quiet) as progress:
                floors.append(
                    run_on(
                        model=control_model(loaded, seed=seed),
                        name=control_name(name, seed) if name is not None else None,
                        progress=progress,
                        control_of=run,
                        control_seed=seed,
                    )
                )
    finally:
        if spooled:
            remove_spool(spooled)
    if quiet:
        for stored in (run, *floors):
            stdout.print(stored.run_id)
        return
    _print_run_summary(store, run.run_id)
    for seed, floor in enumerate(floors):
        stdout.print(
            f"control (seed {seed}): run {floor.run_id} ({floor.name}); compare with `{command_name()} compare "
            f"{shlex.quote(name) if name else run.run_id}`",
            markup=False,
        )


def _print_probe_tops(heads: list[dict], scores: tuple[str, ...]) -> None:
    """One line: the head with the highest score of each kind, when the run has a probe."""
    if not heads or heads[0][scores[0]] is None:
        return
    tops = [(name, max(heads, key=lambda h: h[name])) for name in scores]
    text = ", ".join(f"{name} {h['layer']}.{h['head']} ({h[name]:.3f})" for name, h in tops)
    print_wrapped(f"probe (SPEC §8), top head per score (layer.head): {text}")


class _progress:
    """Progress bar on stderr: windows, windows/s and ETA (from corpus characters consumed)."""

    def __init__(self, total_chars: int, quiet: bool):
        self.total, self.quiet, self.windows = total_chars, quiet, 0

    def __enter__(self):
        if self.quiet:
            return None
        self.bar = progress_bar("analysing", "{task.fields[windows]:,} windows")
        self.bar.__enter__()
        self.task = self.bar.add_task("analyse", total=self.total, windows=0, rate=0.0)
        return self.update

    def update(self, windows: int, consumed: int) -> None:
        self.windows += windows
        elapsed = self.bar.tasks[0].elapsed or 1e-9
        self.bar.update(self.task, completed=consumed, windows=self.windows, rate=self.windows / elapsed)

    def __exit__(self, *exc):
        if not self.quiet:
            if exc[0] is None:  # an interrupted or failed run stops where it was, not at 100 %
                self.bar.update(self.task, completed=self.total)
            self.bar.__exit__(*exc)
        return False


def _print_run_summary(store, run_id: int) -> None:
    from headatlas.service.reports import queries

    with store.checked_read() as conn:
        info = queries.run_summary(conn, run_id)
        layer_cols, layer_rows = queries.layers(conn, run_id)
        head_cols, head_rows = queries.heads(conn, run_id, sort="within_sentence_lift_dm", top=5)
        rep_cols, rep_rows = queries.heads(conn, run_id, sort="repetition_words_lift_dm", top=5)
        probe_cols, probe_rows = queries.heads(conn, run_id, anchors=0)
    print_wrapped(
        f"run {info['run_id']} ({info['name']}): {info['status']}, {info['windows']:,} windows, "
        f"{info['model_name']} ({info['n_layers']} layers × {info['n_heads']} heads), "
        f"{info['compute_s']:.1f} s compute"
    )
    render_metrics(
        layer_cols,
        layer_rows,
        Format.table,
        title="Layer progression (0-based layers)",
        table_columns=LAYER_TABLE,
        offer_more=False,
    )
    keep = ["layer", "head", "within_sentence", "within_sentence_lift_dm", "top_anchors"]
    render_metrics(
        head_cols,
        head_rows,
        Format.table,
        title="Most within-sentence heads (beyond their distances)",
        table_columns=keep,
        pinned=2,
        offer_more=False,
    )
    keep = ["layer", "head", "repetition", "repetition_words", "repetition_words_lift_dm", "top_anchors"]
    render_metrics(
        rep_cols,
        rep_rows,
        Format.table,
        title="Word-repetition heads (punctuation repeats excluded)",
        table_columns=keep,
        note=queries.LIFT_NOTE,
        pinned=2,
        offer_more=False,
    )
    _print_probe_tops([dict(zip(probe_cols, r, strict=True)) for r in probe_rows], queries.PROBE_COLUMNS)
    name = command_name()
    stdout.print(f"next: {name} query heads --run {run_id} --ci", markup=False, highlight=False)
    stdout.print(
        f'      {name} sql --run {run_id} "SELECT layer, head, within_sentence FROM head_metrics LIMIT 5"',
        markup=False,
        highlight=False,
    )


@app.command()
def models(fmt: Format = FormatOpt) -> None:
    """List what --model takes: the named models (installed, converted), the random shapes and the
    supported model families."""
    from headatlas.service.engine.catalog import model_catalog

    rows = model_catalog()
    columns = ["kind", "model", "family", "what", "state"]
    render(columns, [tuple(r[c] for c in columns) for r in rows], fmt, title="what --model takes")


# --- runs and queries ---------------------------------------------------------------------------
@query_app.command("heads")
def query_heads(
    run: str | None = RunOpt,
    layer: int | None = typer.Option(None, "--layer", "-l", help="Only this layer (0-based)."),
    sort: str | None = typer.Option(
        None,
        "--sort",
        "-s",
        metavar="METRIC",
        help=f"Sort by this metric, largest first (--asc: smallest first); one of {', '.join(SORTABLE)}.",
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
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import queries

    if asc and sort is None:
        raise ParameterError("--asc orders the --sort metric: pass --sort METRIC too")
    table = HEAD_TABLE if sort is None or sort in HEAD_TABLE else [*HEAD_TABLE[:2], sort, *HEAD_TABLE[2:]]
    check = None if layer is None else lambda r: _check_layer_head(r, layer, None)
    _query(
        (db, at),
        run,
        fmt,
        queries.heads,
        "heads",
        check=check,
        table_columns=table,
        note=queries.LIFT_NOTE,
        view=TableView.of(columns, wide),
        pinned=3 if sort is not None else 2,
        layer=layer,
        sort=sort,
        top=top,
        ci=ci,
        ascending=asc,
    )


@query_app.command("distances")
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
    from headatlas.service.reports import queries

    if max_distance is not None and max_distance < 1:
        raise ParameterError(f"--max-distance {max_distance}: pass a distance of 1 or more")
    if split not in (None, "attended"):
        raise ParameterError(f"--split {split!r}: the only split is 'attended' (signal vs noise pairs)")
    store = _store(db, at)
    with store.checked_read() as conn:
        r = _run(conn, run)
        _check_layer_head(r, layer, head)
        names, rows = queries.distances(conn, r.run_id, layer=layer, head=head, split=split is not None, ci=ci)
        unreliable = _interval_warnings(conn, r) if ci else []
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


@query_app.command("boundaries")
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
    distance), attention to separators vs uniform."""
    from headatlas.service.reports import queries

    _query(
        (db, at),
        run,
        fmt,
        queries.boundaries,
        "sentence boundaries per layer",
        note=queries.LIFT_NOTE,
        view=TableView.of(columns, wide),
        ci=ci,
    )


@query_app.command("layers")
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
    from headatlas.service.reports import queries

    _query(
        (db, at),
        run,
        fmt,
        queries.layers,
        "layers",
        table_columns=LAYER_TABLE,
        note=queries.LIFT_NOTE,
        view=TableView.of(columns, wide),
        ci=ci,
    )


@query_app.command("mixing")
def query_mixing(
    run: str | None = RunOpt,
    layer: int | None = typer.Option(
        None, "--layer", "-l", help="Show this layer's heads (0-based); default: one row set per layer."
    ),
    method: list[str] = typer.Option(
        [], "--method", help="attention, attribution, rollout, norm or alti (repeat); default: all stored."
    ),
    columns: str | None = ColumnsOpt,
    wide: bool = WideOpt,
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    at: int | None = AtOpt,
) -> None:
    """Where each output's mixture comes from: mass to self / neighbours / specials / punctuation and mean distance, per method."""
    from headatlas.service.reports import queries

    what = f"layer {layer} heads" if layer is not None else "per layer"
    check = None if layer is None else lambda r: _check_layer_head(r, layer, None)
    _query(
        (db, at),
        run,
        fmt,
        queries.mixing,
        f"mixing, {what}",
        check=check,
        view=TableView.of(columns, wide),
        layer=layer,
        methods=method or None,
    )


@query_app.command("discrepancy")
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
    from headatlas.service.reports import queries

    store = _store(db, at)
    with store.checked_read() as conn:
        r = _run(conn, run)
        names, rows = queries.discrepancy(conn, r.run_id, method=method, top=top)
        layer_cols, layer_rows = queries.discrepancy_layers(conn, r.run_id, method=method)
    view = TableView.of(columns, wide)
    title = f"run {r.run_id} ({r.name}): attention vs {method}, per head"
    render(names, rows, fmt, title=title, view=view if view.picked or view.wide else None)
    if fmt == Format.table:
        render(layer_cols, layer_rows, fmt, title="layer progression")


@app.command()
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
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import compare as comparison
    from headatlas.service.reports import queries
    from headatlas.service.reports.intervals import scheme_of

    with _store(db, at).checked_read() as conn:
        a = _run(conn, run_a)
        bs = [_run(conn, run_b)] if run_b is not None else comparison.controls_of(conn, a)
        if not bs:
            raise ParameterError(
                f"compare {run_a}: run {a.run_id} ({a.name}) has no control run; pass RUN_B, "
                "or analyse again with --control"
            )
        results = [(b, comparison.compare(conn, a, b, metrics=metric, layer=layer, head=head, heads=heads)) for b in bs]
        unreliable = _interval_warnings(conn, a, *bs)
    table = (
        comparison.TABLE_COLUMNS
        if (heads or head is not None)
        else [c for c in comparison.TABLE_COLUMNS if c != "head"]
    )
    view = TableView.of(columns, wide)
    if fmt != Format.table and len(results) > 1:  # one document: every control's rows, named
        names = ["run_b", *results[0][1][0]]
        render(names, [(b.run_id, *r) for b, (_, rows) in results for r in rows], fmt, view=view)
        _print_warnings(unreliable)
        return
    for b, (names, rows) in results:
        floor = (
            f" (B is A's random-weights control, seed {comparison.control_seed(b)}: the floor every claim should beat)"
            if comparison.is_control(a, b)
            else ""
        )
        differ = comparison.parameter_differences(a, b)
        if differ and fmt == Format.table:
            stderr.print(f"note: the runs were analysed with different parameters ({'; '.join(differ)})", markup=False)
        render_metrics(
            names,
            rows,
            fmt,
            table_columns=table,
            view=view,
            note=f"{comparison.VERDICT_NOTE}. {queries.LIFT_NOTE}",
            schemes=[scheme_of(a.params), scheme_of(b.params)],
            title=f"A = run {a.run_id} ({a.name}, {a.n_layers} layers) vs B = run {b.run_id} ({b.name}, "
            f"{b.n_layers} layers){floor}",
        )
    _print_warnings(unreliable)


@query_app.command("roles")
def query_roles(
    run: str | None = RunOpt,
    stability: bool = typer.Option(
        False,
        "--stability",
        help="Also test every role on each half of the run's replicate groups (alternate groups in id order: disjoint sets of "
        "documents where groups hold whole documents) and mark it stable when it holds on both.",
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
    the run's random-weights controls earn."""
    from headatlas.service.reports import compare, roles
    from headatlas.service.reports.intervals import scheme_of

    with _store(db, at).checked_read() as conn:
        r = _run(conn, run)
        names, rows = roles.roles(conn, r.run_id, stability=stability)
        offered = roles.offered_roles(roles.causal_run(conn, r.run_id))
        controls = [
            (compare.control_seed(c), c, roles.role_counts(*roles.roles(conn, c.run_id)))
            for c in compare.controls_of(conn, r)
        ]
    family = roles.family_size(names, rows)
    tested = (
        f"Holm–Bonferroni over {family} (head, role) tests, α = {roles.ALPHA:g}"
        if family
        else "no replicate groups: each value tested against its threshold, uncorrected"
    )
    note = roles.ROLES_NOTE + (f". {roles.STABILITY_NOTE}" if stability else "")
    if "induction" in offered:
        note += f". {roles.PROBE_NOTE}"
    # the probe's columns where a role read a probe score (decoders' induction and duplicate-token)
    probed = any(row[names.index("probe_score")] is not None for row in rows)
    hidden = ("rule", "test", "p", "family") + (() if probed else ("probe_score", "probe_min"))
    table = [c for c in names if c not in hidden]
    render_metrics(
        names,
        rows,
        fmt,
        title=f"run {r.run_id} ({r.name}): head roles (SPEC §7); {tested}",
        table_columns=table,
        note=note,
        schemes=[scheme_of(r.params)],
        view=TableView.of(columns, wide),
        pinned=3,
    )
    if fmt != Format.table:
        return
    counts, stable = roles.role_counts(names, rows, offered), roles.stable_counts(names, rows)
    held = ", ".join(
        f"{role} {n}" + (f" ({stable[role]} stable)" if stable is not None and role in stable else "")
        for role, n in counts.items()
    )
    print_wrapped(f"heads per role: {held}")
    if stability and stable is None:
        stdout.print("stability: a half holds under 2 replicate groups; no test on halves", markup=False)
    for seed, control, control_counts in controls:
        earned = sum(n for role, n in control_counts.items() if role != roles.NONE)
        stdout.print(
            f"control seed {seed} (run {control.run_id}, {control.name}): {earned} (head, role) earned",
            markup=False,
            highlight=False,
        )


# the help lists the relations, as tests/test_cli_sql.py checks them against a new database
@app.command(help=f"Run one read-only SELECT against the results; --run keeps to one run. {relations.sql_help()}")
def sql(
    statement: str = typer.Argument(..., help="One SELECT or WITH … SELECT statement, or - to read it from stdin."),
    run: str | None = typer.Option(
        None,
        "--run",
        "-r",
        help="Only this run (id, name or alias): every table and view with a run_id column holds its rows alone.",
    ),
    db: str = DbOpt,
    fmt: Format = FormatOpt,
    max_rows: int = options.setting("sql_max_rows", "--max-rows", help="Row cap."),
    timeout: float = options.setting("sql_timeout_s", "--timeout", help="Time limit in seconds."),
    memory_limit: str | None = typer.Option(
        None, "--memory-limit", help="Memory the query may use, e.g. 2GB (default: a quarter of this machine's)."
    ),
    temp_limit: str = typer.Option("4GB", "--temp-limit", help="Disk the query may spill to, e.g. 10GB."),
    at: int | None = AtOpt,
) -> None:
    from headatlas.service.storage.readonly import run_readonly_sql

    text = sys.stdin.read() if statement == "-" else statement
    run_id = None
    if run is not None:
        with _store(db, at).checked_read() as conn:
            run_id = _run(conn, run).run_id
    result = run_readonly_sql(
        db,
        text,
        max_rows=max_rows,
        timeout_s=timeout,
        memory_limit=memory_limit,
        temp_limit=temp_limit,
        run_id=run_id,
        at=at,
    )
    render(result.columns, result.rows, fmt, truncated=result.truncated)
    if run is None and fmt == Format.table and result.runs > 1 and "run_id" not in text.lower():
        note(
            f"the database holds {result.runs} runs and the views hold them all: pass --run RUN for one, or select run_id"
        )


@app.command()
def metrics(fmt: Format = FormatOpt) -> None:
    """List every metric of the views (head_metrics, layer_metrics): its column, SPEC section and
    one-line definition, as declared once in service/metrics.py."""
    from headatlas.service.metrics import reference

    columns, rows = reference()
    render_metrics(
        columns,
        rows,
        fmt,
        title="metrics (columns of head_metrics and layer_metrics)",
        table_columns=["column", "spec", "definition"],
    )


@db_app.command("upgrade")
def db_upgrade(db: str = DbOpt) -> None:
    """Create the schema or apply pending migrations."""
    from headatlas.service.storage.backends import label
    from headatlas.service.storage.db import upgrade

    before, after = upgrade(db)
    stdout.print(f"{label(db)}: schema {before or 'none'} → {after}", markup=False)


@db_app.command("current")
def db_current(db: str = DbOpt) -> None:
    """Show the schema revision of the database and the one this headatlas needs."""
    from headatlas.service.storage.backends import label
    from headatlas.service.storage.db import check_not_foreign, current_revision, head_revision, transaction

    with transaction(db, read_only=True) as conn:
        check_not_foreign(conn, db)
        current = current_revision(conn)
    stdout.print(f"{label(db)}: schema {current or 'none'}, needed {head_revision()}", markup=False)


@db_app.command("compact")
def db_compact(
    db: str = DbOpt,
    keep_days: float = typer.Option(
        7.0,
        "--keep-days",
        min=0,
        help="A lake: keep the snapshots of the last N days (older ones expire: --at can no longer read them, and "
        "the files only they used are deleted); 0 keeps the current one only.",
    ),
    fmt: Format = FormatOpt,
) -> None:
    """Compact the storage: a lake merges its small Parquet files and expires old snapshots (DuckLake's own
    functions); a file is checkpointed."""
    from headatlas.service.storage.backends import open_backend
    from headatlas.service.storage.db import check_schema, transaction

    backend = open_backend(db)
    with transaction(backend, read_only=True) as conn:
        check_schema(conn, backend)
    done = backend.maintain(older_than_days=keep_days)
    render(list(done), [tuple(done.values())], fmt, title=f"compacted {backend.label}")


@db_app.command("copy")
def db_copy(
    src: str = typer.Argument(..., help="Source database: a file or a ducklake:… URL."),
    dst: str = typer.Argument(..., help="Target: a new file, or a lake whose catalogue holds no runs yet."),
    fmt: Format = FormatOpt,
) -> None:
    """Copy every run and schedule from one database to another (file → lake, lake → file, …), verified by
    counting each table on both sides. With a lake, --data-path names where its files go."""
    from headatlas.service.storage.backends import label
    from headatlas.service.storage.copy import copy_database

    copied = copy_database(src, dst)
    render(
        ["table", "source_rows", "target_rows"],
        [(c.table, c.source, c.target) for c in copied],
        fmt,
        title=f"copied {label(src)} → {label(dst)}",
    )


@app.command()
def config() -> None:
    """Show the settings read from HEADATLAS_* environment variables; a value outside its allowed
    range is marked BAD with the reason, and the command then exits 2."""
    from headatlas.service.config import check_values

    rows, bad = check_values(os.environ)  # a lake's catalogue password is never printed
    render(["variable", "value", "default", "check", "meaning"], rows, Format.table)
    if bad:
        print(f"error: {len(bad)} bad setting{'s' if len(bad) > 1 else ''}: {', '.join(bad)}", file=sys.stderr)
        raise typer.Exit(2)


def _query(
    db: str | tuple[str, int | None],
    run: str | None,
    fmt: Format,
    query,
    title: str,
    check=None,
    table_columns=None,
    note: str | None = None,
    view: TableView = TableView(),
    pinned: int = 1,
    **kwargs,
) -> None:
    """Open the store, resolve the run, ``check(run)`` the options against it, call one query
    function, render its rows (``view``, ``pinned``: see ``render_metrics``)."""
    from headatlas.service.reports.intervals import scheme_of

    where, at = db if isinstance(db, tuple) else (db, None)
    with _store(where, at).checked_read() as conn:
        r = _run(conn, run)
        if check is not None:
            check(r)
        columns, rows = query(conn, r.run_id, **kwargs)
        unreliable = _interval_warnings(conn, r) if kwargs.get("ci") else []
    render_metrics(
        columns,
        rows,
        fmt,
        title=f"run {r.run_id} ({r.name}): {title}",
        table_columns=table_columns,
        note=note,
        schemes=[scheme_of(r.params)],
        view=view,
        pinned=pinned,
    )
    _print_warnings(unreliable)


def _interval_warnings(conn, *runs) -> list[str]:
    """Each run's warning that its intervals rest on too few replicate groups (SPEC §5d)."""
    from headatlas.service.reports.queries import interval_warning

    return [w for w in (interval_warning(conn, r.run_id) for r in runs) if w]


def _print_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        stderr.print(f"warning: {warning}", markup=False, highlight=False, soft_wrap=True)


_run = run_commands.resolve  # the run a command names, or the default one, with a note when unfinished


def _check_layer_head(run, layer: int, head: int | None) -> None:
    from headatlas.service.errors import ParameterError

    if not 0 <= layer < run.n_layers:
        raise ParameterError(f"--layer {layer}: run {run.run_id} has layers 0..{run.n_layers - 1} (0-based)")
    if head is not None and not 0 <= head < run.n_heads:
        raise ParameterError(f"--head {head}: run {run.run_id} has heads 0..{run.n_heads - 1} (0-based)")


# inspect, plot, report, export: their own module
from headatlas.cli.visual import register as _register_visual  # noqa: E402

_register_visual(app)

from headatlas.cli.effects_command import register as _register_effects  # noqa: E402

_register_effects(app)


class _NoInterruptTracebacks(logging.Filter):
    """Ctrl-C can land while a library closes a connection; SQLAlchemy then logs the interrupt
    with a traceback. The user asked to stop: the one-line resume hint is the whole answer."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def main() -> None:
    for handler in [logging.lastResort, *logging.getLogger().handlers]:
        if handler is not None:
            handler.addFilter(_NoInterruptTracebacks())
    os.environ.setdefault("HF_HUB_OFFLINE", "1") if _default_model_only() else None
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        app()
    except Interrupted:
        _leave_now(130)
    except HeadatlasError as exc:  # raised outside a command (Commands.invoke maps those inside)
        error(str(exc))
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        error(INTERRUPTED)
        _leave_now(130)


def _leave_now(code: int) -> None:
    """Exit without the interpreter's teardown of torch and its threads, which took 2–4 s on a
    loaded machine after Ctrl-C; by now every finished result is stored and every file closed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _default_model_only() -> bool:
    model = os.environ.get("HEADATLAS_MODEL", Settings.default("model"))
    return "--model" not in sys.argv and "-m" not in sys.argv and model == "default"


from headatlas.cli.queue_commands import register as _register_queue_commands  # noqa: E402

_register_queue_commands(app)  # submit, worker, writer, status, retry

from headatlas.cli.schedule_commands import register as _register_schedule_commands  # noqa: E402

_register_schedule_commands(app, query_app)  # schedule …, beat, query trend

if __name__ == "__main__":
    main()
