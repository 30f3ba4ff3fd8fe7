"""`headatlas effects`: which heads the model needs, measured on a corpus in this process (SPEC §9).

Registered on the main app by ``register(app)``; thin like the rest of the CLI: parse options, call
``service.engine.effect_runs.measure_effects``, render its table.
"""

from __future__ import annotations

import typer

from headatlas.cli import options
from headatlas.cli.output import Format, render, stderr

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
    from headatlas.service.engine.corpus import corpus_files
    from headatlas.service.engine.effect_runs import measure_effects
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.model_check import check_loaded, check_model_spec
    from headatlas.service.measures.effects import parse_kinds

    chosen = parse_kinds(kinds)
    params = analysis.params
    corpus_files(corpus)  # a missing corpus is said before the model loads
    check_model_spec(analysis.model, seq_len=params.seq_len, device=analysis.device)
    loaded = load_model(analysis.model, device=analysis.device)
    check_loaded(loaded, params.seq_len)
    batch = int(analysis.batch_size) if str(analysis.batch_size).isdigit() else 4
    passes = loaded.n_heads * (loaded.n_layers + 1) / 2 * len([k for k in chosen if k != "gradient"])
    stderr.print(
        f"measuring {', '.join(chosen)} on {windows} windows: about {passes:.0f} forward passes' worth per window",
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
