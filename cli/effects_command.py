"""`headatlas effects` and `headatlas prune`: which heads the model needs, measured on a corpus in this process (SPEC §9).

Registered on the main app by ``register(app)``; thin like the rest of the CLI: parse options into a
request, call its operation (``service.operations.effects.measure``, ``service.operations.pruning.prune``),
render what it says and returns.
"""

from __future__ import annotations

import typer

from headatlas.cli import options
from headatlas.cli.console import print_note, stderr, stdout
from headatlas.cli.formats import Format, TableView, render
from headatlas.cli.tables import print_table
from headatlas.service.wording import counted

WindowsOpt = typer.Option(
    16,
    "--windows",
    min=1,
    help="Windows to measure, spread over the corpus's documents (each head's ablation is a partial forward "
    "pass per window: cost grows with windows × layers × heads).",
)
ReferenceOpt = typer.Option(
    None,
    "--reference",
    min=1,
    help="Mean ablation: the first N windows give each head's mean output (default: a run's own when it holds "
    "effects, else 256).",
)
EffectsOpt = typer.Option(
    "zero,mean",
    "--effects",
    help="Effects to measure: zero and mean ablation, gradient importance and atp (attribution patching: mean "
    "ablation's first-order estimate from one backward pass); the last two for objectives that are losses only.",
)
CheckTopOpt = typer.Option(
    0,
    "--check-top",
    min=0,
    metavar="K",
    help="With --effects atp on a corpus: check AtP against exact mean ablation of every head on the same windows "
    "(Spearman's ρ over the heads, the top-K recall, and the exact effects of the K heads AtP names).",
)
TopOpt = typer.Option(0, "--top", min=0, help="Show only the N heads with the largest first effect (0: every head).")
QueueOpt = typer.Option(
    False,
    "--queue",
    help="With a run: queue its windows for the workers (`headatlas worker`, stored by `headatlas writer`) rather "
    "than measure them here, and print the run id; again, it queues only the windows neither stored nor queued.",
)
WaitOpt = typer.Option(
    False, "--wait", help="With --queue: show progress until every window is stored, then the table."
)
StreamingOpt = typer.Option(
    False,
    "--streaming",
    help="With a run of a decoder: each KV head in turn keeps only --sink sinks and --recent recent keys (every "
    "query head reading it), and what the objective loses, stored in the run per (S, W) (SPEC §10).",
)
SinkOpt = typer.Option(4, "--sink", min=0, metavar="S", help="With --streaming: the first S tokens stay visible.")
ShowOpt = typer.Option(
    False,
    "--show",
    help="With --streaming: show the run's stored streaming effects of --sink and --recent; measure nothing.",
)
RecentOpt = typer.Option(
    64, "--recent", min=1, metavar="W", help="With --streaming: the W most recent keys stay visible (its own included)."
)


def register(app: typer.Typer) -> None:
    from headatlas.cli import streaming_commands

    app.command()(effects)
    app.command()(prune)
    streaming_commands.register(app)  # policy


@options.analysis_options("model", "device", "seq_len", "batch_size", "text_field", "encoding")
def effects(
    target: str = typer.Argument(
        ...,
        metavar="RUN|CORPUS",
        help="A run (id, name or alias in --db): its effects are measured on its own windows and stored in it. "
        "Or a corpus (.txt/.jsonl/.csv file, directory or glob): measured on it, nothing stored.",
    ),
    *,
    kinds: str = EffectsOpt,
    windows: int = WindowsOpt,
    reference: int | None = ReferenceOpt,
    top: int = TopOpt,
    check_top: int = CheckTopOpt,
    streaming: bool = StreamingOpt,
    sink: int = SinkOpt,
    recent: int = RecentOpt,
    show: bool = ShowOpt,
    db: str = options.Db,
    analysis: options.AnalysisOptions,
    fmt: Format = options.Fmt,
    columns: str | None = options.Columns,
    wide: bool = options.Wide,
    queue: bool = QueueOpt,
    wait: bool = WaitOpt,
    writer_wait: float = options.WriterWait,
    broker: str = options.Broker,
) -> None:
    """Which heads the model needs: every head removed in turn, and what the model's objective loses.

    For each head, effect = O(ablated) − O(intact) over --windows windows, with its 95% interval
    (jackknife over replicate groups by document): zero ablation sets the head's output to 0, mean
    ablation to its mean over the reference windows; gradient importance is |∂O/∂gate|; atp
    (attribution patching) is mean ablation's first-order estimate, Σ (mean − z)·∂O/∂z, every head
    from one forward and one backward pass: a screen, which --check-top K checks against exact mean
    ablation. O is the model's own: next-token loss (nats) for decoders with a tied LM head,
    embedding drift (1 − cos of the pooled embedding) for sentence-embedding encoders such as the
    default.

    Given a finished run, the effects are those `analyze --effects` stores, on the run's first --windows
    windows, stored in the run (Ctrl-C keeps every finished window; the same command resumes; more
    windows are added to those it holds); `query heads`, `query roles` and `prune` then use them. With
    --queue the workers measure them, one window a task, and the writer stores them: the same values.
    Given a corpus, they are measured in this process and nothing is stored.

    A run's table also gives each effect normalised within its layer (<effect>_layer = v / ‖v of the
    layer's heads‖₂, Michel et al. 2019), the head's primary role, noise_share and the probe's scores
    (--wide, --columns, CSV and JSON), and says how many heads' intervals lie above 0.

    With --streaming (a run of a decoder), each KV head is restricted instead: query i attends only to
    the keys j ≤ i with j < S (--sink) or i − j < W (--recent), renormalised, for every query head that
    reads it (grouped-query attention), on the run's --windows windows; effect = O(streaming) − O(intact)
    with its interval, beside two predictors from the atlas: the head's attention mass beyond sinks + W
    in the intact model (beyond) and its share of high-similarity pairs at a distance ≥ W (long_range),
    each with Spearman's ρ against the effect in the note. Each restriction is stored in the run by
    (S, W) (the streaming_effects table); measured again, it is replaced.
    """
    from headatlas.service.storage.store import Store

    store = Store(db)
    ref = _run_ref(target, store, db)
    if show and not streaming:
        from headatlas.service.errors import Param, ParameterError

        raise ParameterError(Param("show", True), ": shows stored streaming effects: add --streaming")
    if streaming:
        _streaming(
            store,
            ref,
            target,
            sink=sink,
            recent=recent,
            windows=windows,
            show=show,
            refused={"--effects": kinds != "zero,mean", "--queue": queue, "--wait": wait, "--check-top": check_top},
            analysis=analysis,
            fmt=fmt,
        )
        return
    if ref is None and (queue or wait):
        from headatlas.service.errors import Param, ParameterError

        raise ParameterError(
            Param("queue" if queue else "wait", True),
            ": queues a run's windows (stored in it); give a run, not a corpus",
        )
    if ref is not None and wait and not queue:
        from headatlas.service.errors import Param, ParameterError

        raise ParameterError(Param("wait", True), ": waits for the workers: add --queue")
    if ref is not None and queue:
        view = TableView.of(columns, wide)
        _queue_to_run(
            store,
            ref,
            kinds=kinds,
            windows=windows,
            reference=reference,
            fmt=fmt,
            view=view,
            db=db,
            broker=broker,
            wait=wait,
            writer_wait=writer_wait,
        )
        return
    if ref is not None:
        if check_top:
            from headatlas.service.errors import Param, ParameterError

            raise ParameterError(
                Param("check_top", check_top), ": checks AtP on a corpus (nothing stored); give a corpus, not a run"
            )
        view = TableView.of(columns, wide)
        _add_to_run(
            store, ref, kinds=kinds, windows=windows, reference=reference, analysis=analysis, fmt=fmt, view=view
        )
        return
    from headatlas.service.operations.effects import measure
    from headatlas.service.operations.requests import EffectsRequest

    request = EffectsRequest.build(
        target, kinds=kinds, windows=windows, reference=reference or 256, check_top=check_top, **analysis.values
    )
    table = measure(request, _said)
    rows = table.rows
    if top:
        rows = sorted(rows, key=lambda r: -abs(r[2]) if r[2] == r[2] else 0.0)[:top]
    render(table.columns, rows, fmt, title=f"head effects: {table.model}")
    if fmt == Format.table:
        stderr.print(f"note: {table.note()}; {table.seconds:.1f} s", highlight=False, soft_wrap=True)
    if table.check is not None:  # on stderr in every format: the table holds both columns
        stderr.print(f"check: {table.check.describe(table.unit)}", highlight=False, soft_wrap=True)


def _streaming(store, ref, target: str, *, sink, recent, windows, show, refused, analysis, fmt) -> None:
    """`effects RUN --streaming`: the run's KV heads streaming, measured, stored and shown (``show``:
    those stored, nothing measured)."""
    from headatlas.service.errors import Param, ParameterError
    from headatlas.service.operations.streaming_runs import StreamingRequest, measure_streaming, stored_streaming

    if ref is None:
        raise ParameterError(
            Param("streaming", True),
            f": measures a run's KV heads and stores them in it; {target} is a corpus: "
            "analyse it first (`headatlas analyze`), then give the run",
        )
    for option, given in refused.items():
        if given:
            raise ParameterError(
                Param("streaming", True), f": measures the streaming restriction alone; leave out {option}"
            )
    if show:
        found = stored_streaming(store, ref, sink, recent)
        if found is None:
            raise ParameterError(
                Param("show", True),
                f": run {ref} holds no streaming effects of --sink {sink} --recent {recent}; measure them (leave out "
                "--show)",
            )
        _show_streaming(found, fmt)
        return
    from headatlas.service.analysis_options import parse_batch_size

    size = parse_batch_size(analysis.batch_size)  # auto: one window a pass (each KV head a copy of it)
    request = StreamingRequest(
        ref, sink=sink, recent=recent, windows=windows, device=analysis.device, batch_size=1 if size == "auto" else size
    )
    _show_streaming(measure_streaming(store, request, _said), fmt)


def _show_streaming(table, fmt) -> None:
    run = table.run
    render(table.columns, table.rows, fmt, title=f"run {run.run_id} ({run.name}): streaming KV heads")
    took = f"; {table.seconds:.1f} s" if table.measured else " (stored)"
    stderr.print(f"note: {table.note()}{took}", highlight=False, soft_wrap=True)


def _run_ref(target: str, store, db: str) -> str | int | None:
    """The run ``target`` names (its id or name), or None where it is a corpus on disk (a file,
    directory or glob match of that name is a corpus, whatever runs are stored); neither: said as
    both, not as a missing file."""
    import glob
    from pathlib import Path

    from headatlas.service.errors import CorpusError, RunNotFound
    from headatlas.service.storage.store import resolve_run

    if target == "-" or Path(target).exists() or glob.glob(target):
        return None
    ref = int(target) if target.isdigit() else target
    if store.backend.exists():
        try:
            with store.checked_read() as conn:
                resolve_run(conn, ref, any_status=True)
            return ref
        except RunNotFound:
            pass
    raise CorpusError(
        f"{target}: no such corpus (file, directory or glob) and no run of that id, name or alias in {db}",
        hint="give a corpus path, or a run as `headatlas runs` lists them (and --db where they are stored)",
    )


# `effects RUN`'s table: each effect first stored of these, with its per-layer normalisation, and the
# head's role, fitted to 100 characters; the rest (intervals of the normalised values, drifts,
# noise_share, the probe's scores) in --wide, --columns, CSV and JSON
EFFECT_TABLE = ("effect_mean", "effect_mean_layer", "importance", "importance_layer", "role")
EFFECT_TABLE_ZERO = ("effect_zero", "effect_zero_layer", "role")  # a run without mean ablation or importance


def _effect_table(columns: list[str]) -> list[str]:
    chosen = [c for c in EFFECT_TABLE if c in columns]
    if not any(c in columns for c in ("effect_mean", "importance")):
        chosen = [c for c in EFFECT_TABLE_ZERO if c in columns]
    return ["layer", "head", *chosen]


def _add_to_run(store, ref: str | int, *, kinds, windows, reference, analysis, fmt, view) -> None:
    """`effects RUN`: the run's effects measured and stored, then shown as `query heads` reads them."""
    from headatlas.service.operations.added_effects import add
    from headatlas.service.operations.requests import AddEffectsRequest

    request = AddEffectsRequest.build(
        ref, kinds=kinds, windows=windows, reference=reference, device=analysis.values.get("device", "auto")
    )
    added = add(store, request, _said)
    run = added.run
    said = _show_effects(store, run, fmt=fmt, view=view)
    # on stderr in every format: what was measured now
    stderr.print(
        f"note: {counted(added.measured, 'window')} measured now, {added.windows} stored in all"
        + (f"; {said[0]}" if said[0] else "")
        + f"; {added.seconds:.1f} s",
        highlight=False,
        soft_wrap=True,
    )
    if said[1]:  # how many heads individually matter, in every format
        stderr.print(f"note: {said[1]}", highlight=False, soft_wrap=True)


def _show_effects(store, run, *, fmt, view) -> tuple[str | None, str | None]:
    """The run's effects as `query heads` reads them; returns (the effects' note, how many heads'
    intervals lie above 0)."""
    from headatlas.cli.metric_tables import render_metrics
    from headatlas.service.reports.effect_queries import effects as effect_rows
    from headatlas.service.reports.effect_queries import significance_note
    from headatlas.service.storage.effect_rows import effect_note

    with store.checked_read() as conn:
        columns, rows = effect_rows(conn, run.run_id, ci=True)
        note = effect_note(conn, run.run_id)
        above = significance_note(conn, run.run_id, (columns, rows))
    render_metrics(
        columns,
        rows,
        fmt,
        title=f"run {run.run_id} ({run.name}): head effects",
        table_columns=_effect_table(columns),
        view=view,
        pinned=2,
        intervals=[c for c in ("effect_mean", "effect_zero") if c in columns][:1],
    )
    return note, above


def _queue_to_run(
    store, ref: str | int, *, kinds, windows, reference, fmt, view, db, broker, wait, writer_wait
) -> None:
    """`effects RUN --queue`: the run's windows not stored queued for the workers, as `submit`
    queues a corpus's batches; the run id on stdout, or with --wait the table once they are stored."""
    from headatlas.cli.messages import runnable
    from headatlas.cli.queue_commands import _settings, _stranded_s, _wait
    from headatlas.service.operations.queued_effects import submit_added_effects
    from headatlas.service.operations.requests import AddEffectsRequest
    from headatlas.service.statuses import RunStatus

    request = AddEffectsRequest.build(ref, kinds=kinds, windows=windows, reference=reference)
    settings = _settings(db=db, broker_url=broker)
    if wait:
        _stranded_s()  # refused before anything is queued

    def queue(only=None):  # `only`: batches found stranded, queued again as every missing one is
        return submit_added_effects(store, request, settings, writer_wait_s=writer_wait, events=_said)

    sub = queue()
    if sub.status == RunStatus.DONE:
        stderr.print(
            f"run {sub.run_id} ({sub.name}) holds the effects of these {counted(sub.windows, 'window')}: nothing queued"
        )
    else:
        stderr.print(
            f"run {sub.name}: effects on {counted(sub.windows, 'window')}, {sub.batches:,} not stored yet, one a "
            f"batch: queued {sub.queued:,}, {sub.skipped:,} queued already"
        )
    if sub.run_id is None:
        stderr.print(
            runnable(
                "no writer has opened the run's effects yet: start `headatlas writer`; the batches wait in the queue"
            )
        )
    if not wait:
        stdout.print(sub.run_id if sub.run_id is not None else sub.name)
        return
    if sub.status != RunStatus.DONE:
        _wait(settings, sub, resubmit=queue, retried_by="`headatlas effects RUN --queue` again queues them anew")
    run = store.get_run(sub.run_id if sub.run_id is not None else ref)
    said = _show_effects(store, run, fmt=fmt, view=view)
    stderr.print(
        f"note: {counted(sub.queued, 'window')} queued now" + (f"; {said[0]}" if said[0] else ""),
        highlight=False,
        soft_wrap=True,
    )
    if said[1]:
        stderr.print(f"note: {said[1]}", highlight=False, soft_wrap=True)


def _said(event) -> None:
    """What ``effects`` and ``prune`` say on stderr as they measure: the plan, the run pruned, each
    batch of windows or step of a curve, and the run's note."""
    from headatlas.cli.app import cli_terms
    from headatlas.cli.run_commands import notes
    from headatlas.service.errors import render as render_text
    from headatlas.service.operations import events

    if isinstance(event, events.Estimate):
        stderr.print(render_text(event.text, cli_terms()), highlight=False, soft_wrap=True)
    elif isinstance(event, events.WindowsMeasured):
        stderr.print(f"  {event.done}/{event.total} windows", highlight=False)
    elif isinstance(event, events.PruneStarted):
        run = event.run
        stderr.print(f"run {run.run_id} ({run.name}): {run.model_name} on {run.corpus}", highlight=False)
    elif isinstance(event, events.PruneStep):
        from headatlas.service.measures.attribution import about

        left = f", {about(event.left_s)} left" if event.left_s else ""
        stderr.print(f"  {event.order}: step {event.done}/{event.total}{left}", highlight=False)
    else:
        notes(event)


def prune(
    run: str | None = typer.Argument(None, help="Run id, name or alias (default: the latest finished run)."),
    *,
    db: str = options.Db,
    orders: str | None = typer.Option(
        None,
        "--order",
        help="Orders to remove heads in, comma-separated: effect (smallest first), importance (smallest first; "
        "loss objectives), one_per_layer (every layer keeps only its head of largest effect, else importance: "
        "one step), noise (the run's noise_share, largest first), random, and the trivial layer, sinks, "
        "output_norm, output_variance (default: every one the run's objective allows).",
    ),
    step: str = typer.Option("10%", "--step", help="Share of the heads removed at each step."),
    seeds: int = typer.Option(3, "--seeds", help="Random orders (one per seed), 1 to 1000."),
    windows: int = typer.Option(
        16,
        "--windows",
        min=1,
        help="Evaluation windows (without stored effects, as many other windows again set the effect order).",
    ),
    reference: int | None = typer.Option(
        None,
        "--reference",
        min=1,
        help="Windows whose mean output replaces a removed head (default: the run's --effect-reference when it "
        "has effects, else 64).",
    ),
    device: str = typer.Option("auto", "--device", help="Device: auto, cpu, cuda or cuda:N."),
    show: bool = typer.Option(False, "--show", help="Show the run's newest stored curves; measure nothing."),
    out: str | None = typer.Option(None, "--out", "-o", help="Also draw every order's curve into this .png/.svg."),
    until: str | None = typer.Option(
        None,
        "--until",
        metavar="X",
        help="Then say which heads can go before the objective rises by X: in its units (0.05) or a share of the "
        "rise with every head removed (10%); read off the curve of the first --order named, else effect, else "
        "importance: the last step before the first whose increase's upper bound exceeds X.",
    ),
    streaming: bool = typer.Option(
        False,
        "--streaming",
        help="A memory curve instead (a run of a decoder): KV heads turned to streaming (--sink, --recent) "
        "cumulatively in orders — effect and beyond (the run's stored streaming effects of S, W), long_range, noise, "
        "random, layer, sinks — the objective after each step against the KV memory saved; stored with the run.",
    ),
    sink: int = typer.Option(
        4, "--sink", min=0, metavar="S", help="With --streaming: the first S tokens stay visible."
    ),
    recent: int = typer.Option(
        64, "--recent", min=1, metavar="W", help="With --streaming: the W most recent keys stay visible."
    ),
    max_loss: float | None = typer.Option(
        None,
        "--max-loss",
        metavar="X",
        help="With --streaming: the headline's loss budget, memory saved before the increase exceeds X (default 0.05, "
        "the objective's units).",
    ),
    fmt: Format = options.Fmt,
) -> None:
    """Pruning curves: heads removed cumulatively (mean ablation), the model's objective after each step with
    its interval, and the seed paper's claim tested (the area between the noise order and random ones, with an
    interval that includes the spread between seeds, and Spearman's ρ between noise_share and the effect). The
    run gives the model, the corpus and noise_share, and its stored effects (analyze --effects) set the effect
    and importance orders; the curves are measured in this process and stored with the run (--show reads them
    back). Beside an encoder's embedding drift each step also measures neighbour retrieval (top1, mrr, with
    intervals): each sentence of the evaluation windows, embedded alone, ranks by cosine the sentences that
    follow another in their window, for its own successor (chance in the note; SPEC §9).

    With --streaming, a memory curve (SPEC §10): KV heads of a decoder turned to streaming (S sinks, W recent
    keys, every query head reading them) cumulatively in each order, the objective after each step on evaluation
    windows (none of those the run's streaming effects were measured on) against the KV memory saved per
    sequence, 2 · d_head · (n − S − W) · bytes a KV head; the headline gives the memory saved at a loss increase
    of --max-loss, with its interval. `headatlas policy` exports a budget's KV heads."""
    from pathlib import Path

    from headatlas.service.errors import Param, ParameterError
    from headatlas.service.operations.pruning import prune as prune_curves
    from headatlas.service.operations.requests import PruneRequest
    from headatlas.service.storage.effect_rows import retrieval_note
    from headatlas.service.storage.store import Store

    if streaming:
        from headatlas.cli.streaming_commands import memory_command

        for option, given in (("--reference", reference is not None), ("--until", until is not None)):
            if given:
                raise ParameterError(Param("streaming", True), f": a memory curve streams KV heads; leave out {option}")
        memory_command(
            run,
            sink=sink,
            recent=recent,
            orders=orders,
            step=step,
            seeds=seeds,
            windows=windows,
            device=device,
            show=show,
            out=out,
            max_loss=max_loss,
            fmt=fmt,
            db=db,
            said=_said,
        )
        return
    if max_loss is not None:
        raise ParameterError(Param("max_loss", max_loss), ": the budget of a memory curve: add --streaming")
    request = PruneRequest.build(
        run, orders=orders, step=step, seeds=seeds, windows=windows, reference=reference, device=device, show=show
    )
    if until is not None:  # refused before anything is measured
        from headatlas.service.operations.prune_michel import parse_until

        parse_until(until)
    if out is not None:
        from headatlas.service.reports.plots import output_format

        output_format(Path(out))
    pruned = prune_curves(Store(db), request, _said)
    found, saved = pruned.run, pruned.saved
    _render_curves(saved.columns, saved.rows, fmt, title=f"run {found.run_id} ({found.name}): pruning curves")
    meta = saved.meta
    # on stderr in every format: the claim's verdict is the answer
    stderr.print(
        f"note: prune {meta['prune_id']}: O = {meta['objective']} ({meta['unit']}) on {meta['evaluation_windows']} "
        f"evaluation windows ({meta['groups']} replicate groups, {meta['scheme']}); orders from {meta['selection']}; "
        f"removed heads take their mean over the run's first {meta['reference_windows']} windows. {meta['claim']}",
        highlight=False,
        soft_wrap=True,
    )
    said_retrieval = retrieval_note(meta)
    if said_retrieval is not None:
        stderr.print(f"note: {said_retrieval}", highlight=False, soft_wrap=True)
    if until is not None:  # on stderr in every format, after the table: the answer to --until
        from headatlas.service.operations.prune_michel import until_of

        said = until_of(saved, until, request.orders).text()
        stderr.print(said, highlight=False, soft_wrap=True)
    if out is not None:
        from headatlas.service.reports.plots import save
        from headatlas.service.reports.prune_plot import figure_prune

        fig = figure_prune(saved, title=f"pruning curves: run {found.run_id} ({found.name})")
        stderr.print(f"wrote {save(fig, Path(out))}", highlight=False)


# prune's table: the increase with its interval, the objective, and neighbour retrieval where the
# objective has it (an embedding drift, 0 for the intact model: there the objective is the increase
# and gives way to top1 and mrr); it fits 100 characters where every column (the objective's
# interval, the fraction removed, retrieval's intervals) took over 124. CSV and JSON hold them all.
PRUNE_TABLE = ["order", "step", "heads_removed", "increase", "increase_lo", "increase_hi", "objective"]
RETRIEVAL_TABLE = [*PRUNE_TABLE[:-1], "top1", "mrr"]


def _render_curves(columns: list[str], rows: list[tuple], fmt: Format, *, title: str) -> None:
    """The pruning curves: every column in CSV and JSON, ``PRUNE_TABLE`` (``RETRIEVAL_TABLE`` where
    the prune measured retrieval) in a table (narrower than
    it, columns left out from the right), and a line naming the others and where they are."""
    if fmt != Format.table:
        render(columns, rows, fmt, title=title)
        return
    shown = [c for c in (RETRIEVAL_TABLE if "top1" in columns else PRUNE_TABLE) if c in columns]
    index = [columns.index(c) for c in shown]
    print_table(shown, [tuple(r[i] for i in index) for r in rows], title=title, pinned=1)
    rest = [c for c in columns if c not in shown]
    if rest:
        print_note(f"{len(shown)} of {len(columns)} columns; --format csv or json has all ({_named(rest)})")


def _named(columns: list[str]) -> str:
    """``columns`` named for a note of one line: an interval's bounds once (``top1_lo/hi``), with
    their estimate where it is among them (``objective(_lo/hi)``)."""
    out = []
    for column in columns:
        base = column[:-3]
        if column.endswith("_hi") and base + "_lo" in columns:
            continue  # named with its _lo
        if column.endswith("_lo") and base + "_hi" in columns:
            if base not in columns:
                out.append(f"{column}/hi")
        elif column + "_lo" in columns and column + "_hi" in columns:
            out.append(f"{column}(_lo/hi)")
        else:
            out.append(column)
    return ", ".join(out)
