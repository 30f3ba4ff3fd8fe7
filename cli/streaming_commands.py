"""`headatlas prune RUN --streaming` (the memory curve) and `headatlas policy` (its export), SPEC §10.

Thin like the rest of the CLI: parse options into a request, call its operation
(``service.operations.memory_curves``, ``service.operations.streaming_policy``), render the result.
"""

from __future__ import annotations

from pathlib import Path

import typer

from headatlas.cli import options
from headatlas.cli.console import print_note, stderr, stdout
from headatlas.cli.formats import Format, render
from headatlas.cli.tables import print_table

# the memory curve's table: the memory saved against the increase; CSV and JSON hold every column
MEMORY_TABLE = ["order", "step", "kv_heads_streaming", "memory_share", "increase", "increase_lo", "increase_hi"]


def memory_command(
    run, *, sink, recent, orders, step, seeds, windows, device, show, out, max_loss, fmt, db, said
) -> None:
    """`prune RUN --streaming`: the memory curve measured and stored (``show``: the newest stored),
    its table, note and headline, and with ``out`` its figure."""
    from headatlas.service.operations.memory_curves import (
        DEFAULT_MAX_LOSS,
        MemoryCurveRequest,
        check_max_loss,
        headline,
        memory_curve,
        note,
    )
    from headatlas.service.storage.store import Store

    request = MemoryCurveRequest.build(
        run, sink=sink, recent=recent, orders=orders, step=step, seeds=seeds, windows=windows, device=device, show=show
    )
    x = check_max_loss(DEFAULT_MAX_LOSS if max_loss is None else max_loss)
    if out is not None:
        from headatlas.service.reports.plots import output_format

        output_format(Path(out))
    curved = memory_curve(Store(db), request, said)
    found, saved = curved.run, curved.saved
    title = f"run {found.run_id} ({found.name}): memory curve"
    if fmt != Format.table:
        render(saved.columns, saved.rows, fmt, title=title)
    else:
        index = [saved.columns.index(c) for c in MEMORY_TABLE]
        print_table(MEMORY_TABLE, [tuple(r[i] for i in index) for r in saved.rows], title=title, pinned=1)
        print_note("--format csv or json has every column (fraction, memory_saved in bytes, objective(_lo/hi))")
    top = headline(saved, x, request.orders[0] if request.orders and request.orders[0] != "random" else None)
    stderr.print(f"note: {note(saved)}", highlight=False, soft_wrap=True)
    stderr.print(top.text(), highlight=False, soft_wrap=True)
    if out is not None:
        from headatlas.service.reports.plots import save
        from headatlas.service.reports.prune_plot import figure_memory

        fig = figure_memory(
            saved, title=f"memory curve: run {found.run_id} ({found.name})", said=top.text(), max_loss=x
        )
        stderr.print(f"wrote {save(fig, Path(out))}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(policy)


def policy(
    run: str | None = typer.Argument(None, help="Run id, name or alias (default: the latest finished run)."),
    *,
    max_loss: float = typer.Option(
        ...,
        "--max-loss",
        metavar="X",
        help="The loss budget: the longest prefix of the order whose measured increase of the objective stays ≤ X "
        "(in its units, e.g. 0.05 nats) streams.",
    ),
    fmt: str = typer.Option(
        "json",
        "--format",
        help="duo: DuoAttention's full_attention_heads.tsv (rows = layers, columns = KV heads, 1 = full attention, "
        "0 = streaming) and config.json (sink_size, recent_size); json: one file with the run, model, window "
        "length, objective, S, W, order and each KV head's evidence.",
    ),
    out: str | None = typer.Option(
        None, "--out", "-o", metavar="DIR", help="Write the files into this folder (default: print to stdout)."
    ),
    order: str | None = typer.Option(
        None, "--order", help="The memory curve's order to read (default: effect, else the first it holds)."
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Run the model with the policy applied (every streaming KV head at once) on held-out windows and report "
        "the objective's change with its interval.",
    ),
    windows: int = typer.Option(8, "--windows", min=1, help="With --verify: held-out windows to run."),
    device: str = typer.Option("auto", "--device", help="With --verify: auto, cpu, cuda or cuda:N."),
    db: str = options.Db,
) -> None:
    """A streaming policy for a loss budget X, read from the run's newest memory curve (`prune RUN --streaming`):
    the longest prefix of the order whose measured increase stays ≤ X streams (S sinks, W recent keys), every
    other KV head keeps the full cache (SPEC §10). Written in DuoAttention's layout (--format duo) or as JSON with
    the evidence: each KV head's stored streaming effect with its interval. --verify checks it on windows used
    neither to choose the order nor to measure the curve."""
    from headatlas.service.operations import streaming_policy as sp
    from headatlas.service.storage.store import Store

    if fmt not in sp.FORMATS:
        from headatlas.service.errors import Param, ParameterError

        raise ParameterError(Param("format", fmt, quoted=True), f": use {' or '.join(sp.FORMATS)}")
    store = Store(db)
    chosen = sp.choose(store, run, max_loss, order)
    if verify:
        sp.verify(store, chosen, windows=windows, device=device)
    if out is not None:
        for path in sp.write(chosen, fmt, Path(out)):
            stderr.print(f"wrote {path}", highlight=False)
    elif fmt == "json":
        import json

        stdout.print(json.dumps(chosen.as_dict(), indent=2), highlight=False, soft_wrap=True, markup=False)
    else:
        stdout.print(sp.duo_tsv(chosen.full), end="", highlight=False, soft_wrap=True, markup=False)
    stderr.print(f"note: {chosen.text()}", highlight=False, soft_wrap=True)
    if chosen.verification is not None:
        stderr.print(f"note: {chosen.verification.text(chosen.curve.meta['unit'])}", highlight=False, soft_wrap=True)
