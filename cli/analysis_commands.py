"""Analysing in this process: `analyze`, `demo`, and `models` (what --model takes)."""

from __future__ import annotations

import functools
import shlex

import typer

from headatlas.cli import options
from headatlas.cli.output import (
    Format,
    command_name,
    note,
    print_wrapped,
    progress_bar,
    render,
    render_metrics,
    stderr,
    stdout,
)
from headatlas.cli.query_commands import LAYER_TABLE
from headatlas.service.config import Settings

DbOpt, FormatOpt = options.Db, options.Fmt


def register(app: typer.Typer) -> None:
    app.command()(analyze)
    app.command()(demo)
    app.command()(models)


def _store(db: str, at: int | None = None):
    from headatlas.service.storage.store import Store

    return Store(db, at=at)


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


def models(fmt: Format = FormatOpt) -> None:
    """List what --model takes: the named models (installed, converted), the random shapes and the
    supported model families, with their origin (headatlas, or an installed plugin)."""
    from headatlas.service.engine.catalog import model_catalog

    rows = model_catalog()
    columns = ["kind", "model", "family", "what", "state", "origin"]
    render(columns, [tuple(r[c] for c in columns) for r in rows], fmt, title="what --model takes")
