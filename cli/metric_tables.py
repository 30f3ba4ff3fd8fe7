"""Tables of metric rows: each value with its interval folded into one cell, fitted to the width
(intervals left out first where the default table does not fit), and the intervals' footnote."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from headatlas.cli.cells import cell_text
from headatlas.cli.console import fit_width, print_note
from headatlas.cli.formats import DEFAULT_VIEW, Format, TableView, render
from headatlas.cli.tables import all_text_columns, fits, print_table


def merge_intervals(
    columns: list[str], rows: list[tuple], keep: list[str] | None = None, folded: Collection[str] | None = None
) -> tuple[list[str], list[tuple]]:
    """For tables: ``x``, ``x_lo``, ``x_hi`` become one cell "x [lo, hi]"; ``keep``: the columns
    to show (others dropped), in order; ``folded``: the columns whose intervals fold in (default
    all; the others show their value alone)."""
    index = {c: i for i, c in enumerate(columns)}
    shown = [c for c in (keep or columns) if c in index and not (c.endswith(("_lo", "_hi")) and c[:-3] in index)]
    out_rows = []
    for row in rows:
        cells = []
        for c in shown:
            value = row[index[c]]
            lo, hi = index.get(f"{c}_lo"), index.get(f"{c}_hi")
            if folded is not None and c not in folded:
                lo = hi = None
            if lo is not None and hi is not None and value is not None and row[lo] is not None:
                cells.append(f"{cell_text(value)} [{cell_text(row[lo])}, {cell_text(row[hi])}]")
            else:
                cells.append(value)
        out_rows.append(tuple(cells))
    return shown, out_rows


def render_metrics(
    columns: list[str],
    rows: list[tuple],
    fmt: Format,
    *,
    title: str | None = None,
    table_columns: list[str] | None = None,
    note: str | None = None,
    schemes: list[str] | None = None,
    view: TableView = DEFAULT_VIEW,
    pinned: int = 1,
    offer_more: bool = True,
    intervals: Collection[str] | None = None,
    groups: list[int] | None = None,
    yields: Sequence[str] = (),
) -> None:
    """Metric rows: every column in JSON and CSV; in a table the ``table_columns`` (all by
    default) fitted to the width (``print_table``; ``view``: the columns picked, or all) with
    intervals folded into their cells, and ``note`` (what a lift is measured against) printed
    under it, then the intervals' footnote naming their replicate scheme (SPEC §5d): the rows'
    ``interval_by`` column, else ``schemes`` (the runs'). Rows with intervals but no
    ``interval_by`` gain that column from ``schemes``, so JSON and CSV name it too. ``--columns``
    picks among the columns less their ``_lo``/``_hi`` bounds, which come with their metric.
    ``offer_more``: say how to see the columns left out (where the command has ``--columns``).
    ``intervals``: where the default table does not fit with every interval, the only columns
    whose intervals it folds in (the others show their value alone, their bounds in ``--wide``,
    ``--columns``, CSV and JSON). ``yields``: the default table's columns to leave out first
    where it does not fit, the least informative first (then from the right)."""
    has_intervals = any(c.endswith("_lo") for c in columns)
    if has_intervals and "interval_by" not in columns and schemes:
        columns, rows = [*columns, "interval_by"], [(*r, " / ".join(sorted(set(schemes)))) for r in rows]
    available = [c for c in columns if not (c.endswith(("_lo", "_hi")) and c[:-3] in columns)]
    if view.picked is not None:
        view.check(available)
    if fmt != Format.table:
        if view.picked is not None:  # in the order asked for, each with its interval's bounds
            keep = [b for c in view.picked for b in (c, f"{c}_lo", f"{c}_hi") if b in columns]
            keep += ["interval_by"] if has_intervals and "interval_by" in columns and "interval_by" not in keep else []
            index = [columns.index(c) for c in keep]
            columns, rows = keep, [tuple(r[i] for i in index) for r in rows]
        render(columns, rows, fmt, title=title)
        return
    text = all_text_columns(columns, rows)
    if view.picked is not None:
        wanted = list(view.picked)
    else:
        from headatlas.service.reports.query_support import decoder_table

        # a decoder's rows hold attn_to_first in place of attn_to_cls (query_support.for_attention)
        chosen = available if view.wide else decoder_table(list(table_columns or available), columns)
        wanted = [c for c in chosen if c != "interval_by" and c in columns]
    default = view.picked is None and not view.wide
    shown, cells = merge_intervals(columns, rows, wanted)
    bare: list[str] = []  # the columns shown without their intervals, to fit
    for folded in (tuple(intervals), ()) if default and intervals is not None else ():
        if fits(shown, cells, text & set(shown)):
            break
        shown, cells = merge_intervals(columns, rows, wanted, folded)
        bare = [c for c in shown if f"{c}_lo" in columns and c not in folded]
    print_table(
        shown,
        cells,
        title=title,
        fit=not view.wide,
        drop=view.picked is None,
        pinned=pinned,
        text_columns=text & set(shown),
        available=len([c for c in available if c != "interval_by"]) if offer_more else None,
        yields=yields if default else (),
    )
    if bare:
        print_note(f"intervals left out to fit {fit_width()} characters: {', '.join(bare)} (--wide shows them)")
    if note:
        print_note(note)
    if has_intervals:
        from headatlas.service.reports.intervals import interval_note

        if "interval_by" in columns:
            at = columns.index("interval_by")
            schemes = [part for r in rows if r[at] for part in str(r[at]).split(" / ")]
        print_note(interval_note(schemes or [], groups))
