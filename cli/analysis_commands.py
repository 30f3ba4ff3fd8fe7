"""Analysing in this process: `analyze`, `demo`, and `models` (what --model takes)."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any

import typer

from headatlas.cli import options
from headatlas.cli.app import cli_terms
from headatlas.cli.console import print_wrapped, stderr, stdout
from headatlas.cli.formats import Format, render
from headatlas.cli.messages import command_name, note, progress_bar
from headatlas.cli.metric_tables import render_metrics
from headatlas.cli.query_commands import LAYER_TABLE
from headatlas.service.errors import render as render_text
from headatlas.service.wording import counted, seconds

if TYPE_CHECKING:
    from headatlas.service.operations.events import Event
    from headatlas.service.operations.requests import AnalysisRequest

DbOpt, FormatOpt = options.Db, options.Fmt


def register(app: typer.Typer) -> None:
    app.command()(analyze)
    app.command()(demo)
    app.command()(models)


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
    checkpoints: str | None = typer.Option(
        None,
        "--checkpoints",
        metavar="DIR|GLOB|NAME@REV,…",
        help="Analyse every checkpoint of one model instead of --model: a folder of checkpoint folders "
        "(step-N, checkpoint-N, or a trainer_state.json's global_step), a glob of them, or a hub name with "
        "revisions (EleutherAI/pythia-70m@step1000,step2000; needs internet). Each is a run named "
        "<name>-step<N> on the same windows, grouped in the series --name (default: the folder's name); "
        "--probe and --effects apply to each; resumable. Read it with `query trend --series`.",
    ),
) -> None:
    """Analyse a corpus in this process and store the per-head statistics (resumable)."""
    from headatlas.service.operations.requests import AnalysisRequest

    request = AnalysisRequest.build(
        corpus, db=db, name=name, control=control, attribution_chunk=attribution_chunk, **analysis.values
    )
    if checkpoints is not None:
        _analyze_series(request, checkpoints, quiet=quiet)
        return
    _analyze(request, quiet=quiet)


def _analyze_series(request: AnalysisRequest, checkpoints: str, *, quiet: bool) -> None:
    """``analyze --checkpoints``: every checkpoint analysed (service/operations/checkpoint_series.py),
    then one line per step (its run, and the probe's highest scores where there is a probe)."""
    from headatlas.service.analysis_options import DEFAULTS
    from headatlas.service.operations.checkpoint_series import analyze_series, refuse_model
    from headatlas.service.operations.events import ignore
    from headatlas.service.reports import queries

    if str(request.model) != DEFAULTS["model"]:
        refuse_model(request.model, checkpoints)
    done = analyze_series(request, checkpoints, ignore if quiet else _Shown())
    if quiet:
        for _checkpoint, analysed in done.steps:
            stdout.print(analysed.run.run_id)
        return
    rows = []
    for checkpoint, analysed in done.steps:
        with analysed.store.checked_read() as conn:
            cols, heads = queries.heads(conn, analysed.run.run_id, anchors=0)
        found = [dict(zip(cols, r, strict=True)) for r in heads]
        tops = []
        for score in ("prev_token_score", "induction_score"):
            scored = [(h[score], h["layer"], h["head"]) for h in found if h.get(score) is not None]
            tops.append(f"{max(scored)[0]:.3f} (L{max(scored)[1]}H{max(scored)[2]})" if scored else "")
        rows.append((checkpoint.step, analysed.run.run_id, analysed.run.name, *tops))
    render(
        ["step", "run_id", "run", "top prev_token_score", "top induction_score"],
        rows,
        Format.table,
        title=f"series {done.name}: {counted(len(rows), 'checkpoint')} (layers and heads 0-based)",
    )
    at = db_option(request.db)
    name = command_name()
    stdout.print(
        f"next: {name} query trend --series {shlex.quote(done.name)} --metric induction_score{at}",
        markup=False,
        highlight=False,
    )
    stdout.print(f"      {name} query phases --series {shlex.quote(done.name)}{at}", markup=False, highlight=False)


@options.analysis_options("model", "device", "batch_size")
def demo(*, analysis: options.AnalysisOptions, db: str = DbOpt) -> None:
    """Analyse the shipped Wikipedia excerpt with the default model and show what the heads do."""
    from headatlas.service.operations.analysis import demo_request

    _analyze(demo_request(db=db, **analysis.values), quiet=False)


def _analyze(request: AnalysisRequest, *, quiet: bool) -> None:
    """Run the analysis (service/operations/analysis.py), showing its events as they come, then
    what was stored: the run's summary and its controls (``quiet``: their ids alone)."""
    from headatlas.service.operations.analysis import analyze as run_analysis
    from headatlas.service.operations.events import ignore

    done = run_analysis(request, ignore if quiet else _Shown())
    if quiet:
        for stored in (done.run, *done.controls):
            stdout.print(stored.run_id)
        return
    if done.found_finished:
        note(f"run {done.run.run_id} ({done.run.name}) is complete: nothing to analyse")
    at = db_option(request.db)
    _print_run_summary(done.store, done.run.run_id, at)
    name = request.name
    for seed, floor in enumerate(done.controls):
        stdout.print(
            f"control (seed {seed}): run {floor.run_id} ({floor.name}); compare with `{command_name()} compare "
            f"{shlex.quote(name) if name else done.run.run_id}{at}`",
            markup=False,
        )


def db_option(db) -> str:
    """`` --db PATH`` for a command printed to be typed next, where the run is not in the default
    database (without it the printed command would read another database and not find the run)."""
    from headatlas.service.config import Settings

    return "" if str(db) == str(Settings.default("db")) else f" --db {shlex.quote(str(db))}"


class _Shown:
    """An analysis as the command line shows it while it runs: what was read and what loads, the
    estimate of a slow part, a progress bar per pass over the corpus (windows, windows/s and ETA,
    from corpus characters consumed, or windows under ``--max-windows``), and a run reused under
    another name."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, event: Event) -> None:
        from headatlas.service.operations import events

        if isinstance(event, events.CorpusRead):
            summary = event.corpus
            dup = f" ({summary.duplicates} repeated, analysed once)" if summary.duplicates else ""
            loading = f"; loading model {event.model} …" if event.model is not None else ""
            stderr.print(
                f"corpus: {counted(summary.documents, 'document')}{dup}, {summary.chars:,} characters{loading}"
            )
        elif isinstance(event, events.PassStarted):
            if event.control_seed is not None:
                stderr.print(
                    f"control {event.control_seed + 1}/{event.controls}: the same windows through a randomly "
                    f"initialised {event.n_layers}×{event.n_heads} model (seed {event.control_seed}) …"
                )
            self.started, self.windows = event, 0
            self.total = event.done(0, 0)[1]
            self.bar = progress_bar("analysing", "{task.fields[windows]:,} windows")
            self.bar.__enter__()
            self.task = self.bar.add_task("analyse", total=self.total, windows=0, rate=0.0)
        elif isinstance(event, events.Progress):
            self.windows += event.windows
            elapsed = self.bar.tasks[0].elapsed or 1e-9
            completed = self.started.done(self.windows, event.consumed)[0]
            self.bar.update(self.task, completed=completed, windows=self.windows, rate=self.windows / elapsed)
        elif isinstance(event, events.PassEnded):
            if event.completed:  # an interrupted or failed run stops where it was, not at 100 %
                self.bar.update(self.task, completed=self.total)
            self.bar.__exit__(None, None, None)
            self.bar = None
        elif isinstance(event, (events.Estimate, events.Notice)):
            stderr.print(render_text(event.text, cli_terms()), markup=False, highlight=False)
        elif isinstance(event, events.RunReused):
            run, name = event.run, event.name
            note(
                f"run {run.run_id} ({run.name}) holds this corpus, model and parameters already: reused, and "
                f"{name!r} now names it too (--run {shlex.quote(name)})"
            )


def _print_probe_tops(heads: list[dict], scores: tuple[str, ...]) -> None:
    """One line: the head with the highest score of each kind, when the run has a probe."""
    if not heads or heads[0][scores[0]] is None:
        return
    tops = [(name, max(heads, key=lambda h: h[name])) for name in scores]
    text = "; ".join(f"{name} = {h[name]:.3f} at layer {h['layer']}, head {h['head']}" for name, h in tops)
    print_wrapped(f"probe (SPEC §8), the highest score of each kind: {text}")


def _print_run_summary(store, run_id: int, at: str = "") -> None:
    """The run's summary, then the commands to type next (``at``: their ``--db`` option)."""
    from headatlas.service.reports import layer_queries, queries, query_support

    with store.checked_read() as conn:
        info = queries.run_summary(conn, run_id)
        layer_cols, layer_rows = layer_queries.layers(conn, run_id)
        head_cols, head_rows = queries.heads(conn, run_id, sort="within_sentence_lift_dm", top=5)
        rep_cols, rep_rows = queries.heads(conn, run_id, sort="repetition_words_lift_dm", top=5)
        probe_cols, probe_rows = queries.heads(conn, run_id, anchors=0)
    print_wrapped(
        f"run {info['run_id']} ({info['name']}): {info['status']}, {counted(info['windows'], 'window')}, "
        f"{info['model_name']} ({info['n_layers']} layers × {info['n_heads']} heads), "
        f"{seconds(info['compute_s'])} s compute"
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
        note=query_support.LIFT_NOTE,
        pinned=2,
        offer_more=False,
    )
    _print_probe_tops([dict(zip(probe_cols, r, strict=True)) for r in probe_rows], queries.PROBE_COLUMNS)
    name = command_name()
    stdout.print(f"next: {name} query heads --run {run_id} --ci{at}", markup=False, highlight=False)
    stdout.print(
        f'      {name} sql --run {run_id}{at} "SELECT layer, head, within_sentence FROM head_metrics LIMIT 5"',
        markup=False,
        highlight=False,
    )


def models(fmt: Format = FormatOpt) -> None:
    """List what --model takes: the named models (installed, converted), the random shapes and the
    supported model families, with their origin (headatlas, or an installed plugin)."""
    from headatlas.service.engine.catalog import model_catalog

    rows = model_catalog()
    columns = ["kind", "model", "family", "what", "state", "origin"]
    if fmt != Format.table:
        render(columns, [tuple(r[c] for c in columns) for r in rows], fmt, title="what --model takes")
        return
    # within 100 columns, names whole: one table per kind, without the columns its title says (a
    # family row's model is always a path or hub name); a plugin's rows say so in their family,
    # and a line names the plugin
    titles = {
        "named": ("named models (--model NAME)", ["model", "family", "what", "state"]),
        "random": ("random weights (--model random:SHAPE, seed 0)", ["model", "family", "what"]),
        "family": ("model families (--model PATH, hub name or FILE.gguf)", ["family", "what", "state"]),
    }
    converted = "installed, converted in "
    for kind, (title, shown) in titles.items():
        table, folders = [], []
        for r in rows:
            if r["kind"] != kind:
                continue
            row = {c: r[c] for c in shown}
            if r["origin"] != "headatlas":
                row["family"] = f"{row['family']}*"
            if row.get("state", "").startswith(converted):  # the folder on a line of its own: a path
                folders.append(f"{row['model']}: converted in {row['state'].removeprefix(converted)}")
                row["state"] = "installed, converted"
            table.append(tuple(row.values()))
        if table:
            render(shown, table, fmt, title=title)
            for line in folders:
                print_wrapped(line)
            print_wrapped("")
    for origin in dict.fromkeys(r["origin"] for r in rows if r["origin"] != "headatlas"):
        print_wrapped(f"* from {origin}")
