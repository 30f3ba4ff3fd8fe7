"""`headatlas effects` and `headatlas prune`: which heads the model needs, measured on a corpus in this process (SPEC §9).

Registered on the main app by ``register(app)``; thin like the rest of the CLI: parse options, call
``service.engine.effect_runs.measure_effects``, render its table.
"""

from __future__ import annotations

import typer

from headatlas.cli import options
from headatlas.cli.output import Format, print_note, print_table, render, stderr
from headatlas.service.wording import counted

WindowsOpt = typer.Option(
    16,
    "--windows",
    min=1,
    help="Windows to measure, spread over the corpus's documents (each head's ablation is a partial forward "
    "pass per window: cost grows with windows × layers × heads).",
)
ReferenceOpt = typer.Option(
    256, "--reference", min=1, help="Mean ablation: the corpus's first N windows give each head's mean output."
)
EffectsOpt = typer.Option(
    "zero,mean",
    "--effects",
    help="Effects to measure: zero and mean ablation, and gradient importance (objectives that are losses only).",
)
TopOpt = typer.Option(0, "--top", min=0, help="Show only the N heads with the largest first effect (0: every head).")


def register(app: typer.Typer) -> None:
    app.command()(effects)
    app.command()(prune)


@options.analysis_options("model", "device", "seq_len", "batch_size", "text_field", "encoding")
def effects(
    corpus: str = typer.Argument(..., help="A .txt/.jsonl/.csv file, a directory or a glob."),
    *,
    kinds: str = EffectsOpt,
    windows: int = WindowsOpt,
    reference: int = ReferenceOpt,
    top: int = TopOpt,
    analysis: options.AnalysisOptions,
    fmt: Format = options.Fmt,
) -> None:
    """Which heads the model needs: every head removed in turn, and what the model's objective loses.

    For each head, effect = O(ablated) − O(intact) over --windows windows, with its 95% interval
    (jackknife over replicate groups by document): zero ablation sets the head's output to 0, mean
    ablation to its mean over the reference windows; gradient importance is |∂O/∂gate|. O is the
    model's own: next-token loss (nats) for decoders with a tied LM head, embedding drift
    (1 − cos of the pooled embedding) for sentence-embedding encoders such as the default. Measured
    in this process; nothing is stored.
    """
    from headatlas.service.engine.corpus import STDIN_SPEC, iter_documents
    from headatlas.service.engine.effect_runs import measure_effects
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.model_check import check_loaded, check_model_spec
    from headatlas.service.measures.effects import parse_kinds

    chosen = parse_kinds(kinds)
    params = analysis.params
    if corpus != STDIN_SPEC:  # a missing or unreadable corpus is said before the model loads (one line)
        for _ in iter_documents(corpus, text_field=analysis.text_field, encoding=analysis.encoding):
            pass
    check_model_spec(analysis.model, seq_len=params.seq_len, device=analysis.device)
    loaded = load_model(analysis.model, device=analysis.device)
    check_loaded(loaded, params.seq_len)
    batch = int(analysis.batch_size) if str(analysis.batch_size).isdigit() else 4
    passes = loaded.n_heads * (loaded.n_layers + 1) / 2 * len([k for k in chosen if k != "gradient"])
    stderr.print(
        f"measuring {', '.join(chosen)} on {counted(windows, 'window')}: about {passes:.0f} forward passes' worth per window",
        highlight=False,
    )

    def progress(done: int, total: int) -> None:
        stderr.print(f"  {done}/{total} windows", highlight=False)

    table = measure_effects(
        corpus,
        loaded,
        params,
        kinds=chosen,
        windows=windows,
        reference=reference,
        batch_size=max(1, batch),
        text_field=analysis.text_field,
        encoding=analysis.encoding,
        on_batch=progress,
    )
    rows = table.rows
    if top:
        rows = sorted(rows, key=lambda r: -abs(r[2]) if r[2] == r[2] else 0.0)[:top]
    render(table.columns, rows, fmt, title=f"head effects: {table.model}")
    if fmt == Format.table:
        stderr.print(f"note: {table.note()}; {table.seconds:.1f} s", highlight=False, soft_wrap=True)


def parse_step(text: str) -> float:
    """``10%`` or ``0.1`` → 0.1; a ParameterError naming the value otherwise."""
    from headatlas.service.errors import ParameterError

    raw = text.strip()
    try:
        value = float(raw[:-1]) / 100 if raw.endswith("%") else float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise ParameterError(f"--step {text!r}: a share of the heads removed per step, such as 10% or 0.1")
    return value


def prune(
    run: str | None = typer.Argument(None, help="Run id, name or alias (default: the latest finished run)."),
    *,
    db: str = options.Db,
    orders: str | None = typer.Option(
        None,
        "--order",
        help="Orders to remove heads in, comma-separated: effect (smallest first), importance (smallest first; "
        "loss objectives), noise (the run's noise_share, largest first), random (default: every one the run's "
        "objective allows).",
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
    fmt: Format = options.Fmt,
) -> None:
    """Pruning curves: heads removed cumulatively (mean ablation), the model's objective after each step with
    its interval, and the seed paper's claim tested (the area between the noise order and random ones, with an
    interval that includes the spread between seeds, and Spearman's ρ between noise_share and the effect). The
    run gives the model, the corpus and noise_share, and its stored effects (analyze --effects) set the effect
    and importance orders; the curves are measured in this process and stored with the run (--show reads them
    back)."""
    from pathlib import Path

    from headatlas.cli.run_commands import notes
    from headatlas.service.engine.prune_runs import MAX_SEEDS, check_request
    from headatlas.service.engine.pruning import ORDERS
    from headatlas.service.errors import ParameterError
    from headatlas.service.operations.runs import find_run
    from headatlas.service.storage.effect_rows import load_prune
    from headatlas.service.storage.store import Store

    chosen = None if orders is None else [o.strip() for o in orders.split(",") if o.strip()]
    if chosen == []:  # `--order ,` stored a prune with no curve
        raise ParameterError(f"--order {orders!r}: name at least one of {', '.join(ORDERS)}")
    for name in chosen or []:
        if name not in ORDERS:
            raise ParameterError(f"--order {orders!r}: {name!r} is not an order; use {', '.join(ORDERS)}")
    if not 1 <= seeds <= MAX_SEEDS:
        raise ParameterError(f"--seeds {seeds}: use 1 to {MAX_SEEDS} random orders (one curve each)")
    fraction = parse_step(step)
    if out is not None:
        from headatlas.service.reports.plots import output_format

        output_format(Path(out))
    store = Store(db)
    held: list = []  # the run's notes, said once it is known not to be refused
    with store.checked_read() as conn:
        found = find_run(conn, run, held.append)
        saved = load_prune(conn, found.run_id) if show else None
    if not show:
        check_request(found, orders=chosen, seeds=seeds)
    for event in held:
        notes(event)
    if show and saved is None:
        raise ParameterError(
            f"run {found.run_id} ({found.name}) has no stored pruning curves: run `prune` without --show"
        )
    if saved is None:
        from headatlas.service.engine.prune_runs import prune_run

        stderr.print(f"run {found.run_id} ({found.name}): {found.model_name} on {found.corpus}", highlight=False)
        _result, saved = prune_run(
            store,
            found,
            orders=chosen,
            step=fraction,
            seeds=seeds,
            windows=windows,
            reference=reference,
            device=device,
            on_step=lambda name, done, total: stderr.print(f"  {name}: step {done}/{total}", highlight=False),
            on_plan=lambda said: stderr.print(said, highlight=False, soft_wrap=True),
        )
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
    if out is not None:
        from headatlas.service.reports.plots import save
        from headatlas.service.reports.prune_plot import figure_prune

        fig = figure_prune(saved, title=f"pruning curves: run {found.run_id} ({found.name})")
        stderr.print(f"wrote {save(fig, Path(out))}", highlight=False)


# prune's table: the increase with its interval, and the objective; it fits 100 characters where
# every column (the objective's interval, the fraction removed) took 124. CSV and JSON hold them all.
PRUNE_TABLE = ["order", "step", "heads_removed", "increase", "increase_lo", "increase_hi", "objective"]


def _render_curves(columns: list[str], rows: list[tuple], fmt: Format, *, title: str) -> None:
    """The pruning curves: every column in CSV and JSON, ``PRUNE_TABLE`` in a table (narrower than
    it, columns left out from the right), and a line naming the others and where they are."""
    if fmt != Format.table:
        render(columns, rows, fmt, title=title)
        return
    shown = [c for c in PRUNE_TABLE if c in columns]
    index = [columns.index(c) for c in shown]
    print_table(shown, [tuple(r[i] for i in index) for r in rows], title=title, pinned=1)
    rest = [c for c in columns if c not in shown]
    if rest:
        print_note(f"{len(shown)} of {len(columns)} columns; --format csv or json has all ({', '.join(rest)})")
