"""Tables on stdout: headers and numbers never break, text columns wrap, and a table too wide for
``console.fit_width()`` leaves columns out from the right, with a line naming them."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.table import Table
from rich.text import Text

from headatlas.cli.cells import table_cells
from headatlas.cli.console import console_width, fit_width, print_note, print_trimmed, print_wrapped, wraps_text

MIN_TEXT_WIDTH = 20  # a text column (anchors, definitions, paths) may wrap down to this width …
MAX_WORD_WIDTH = 40  # … or to its longest word, up to this (a longer one, a path, breaks anywhere)


def all_text_columns(columns: list[str], rows: list[tuple]) -> set[str]:
    """Columns whose values are all text (names, paths, anchors, definitions): they may wrap."""
    return {
        c
        for i, c in enumerate(columns)
        if any(r[i] is not None for r in rows) and all(isinstance(r[i], str) for r in rows if r[i] is not None)
    }


def _width(widths) -> int:
    """A table's width from its columns' (box.SIMPLE_HEAD without edges: one space of padding
    either side of a column, inner ones only, and a one-space rule between columns)."""
    widths = list(widths)
    return sum(widths) + 3 * max(0, len(widths) - 1)


def _column_widths(columns: list[str], cells: list[list[Text]], text_columns) -> tuple[list[int], list[int]]:
    """Each column's natural width and the least it may take: a text column wraps between words,
    down to its longest word (up to MAX_WORD_WIDTH) or MIN_TEXT_WIDTH; others never break."""
    natural = [
        max([Text(str(c)).cell_len, *(max((len(line) for line in t.plain.split("\n")), default=0) for t in col)])
        for c, col in zip(columns, zip(*cells) if cells else [[] for _ in columns])
    ]
    words = [
        max((len(word) for t in col for word in t.plain.split()), default=0)
        for col in (zip(*cells) if cells else [[] for _ in columns])
    ]
    least = [
        min(w, max(MIN_TEXT_WIDTH, len(c), min(word, MAX_WORD_WIDTH))) if c in text_columns else w
        for c, w, word in zip(columns, natural, words)
    ]
    return natural, least


def _break_words(columns, natural, least, keep, text_columns, width: int) -> list[int]:
    """The least widths once words may break: the widest text column narrows first, one character
    at a time, down to MIN_TEXT_WIDTH (or its header), until the table fits — a long path breaks
    before a model's name does, and only as much as the width needs."""
    least = list(least)
    floor = [min(w, max(MIN_TEXT_WIDTH, len(c))) if c in text_columns else w for c, w in zip(columns, natural)]
    while _width(least[i] for i in keep) > width:
        narrowing = [i for i in keep if least[i] > floor[i]]
        if not narrowing:
            break
        widest = max(narrowing, key=lambda i: least[i])
        least[widest] -= 1
    return least


def fits(columns: list[str], rows: list[tuple], text_columns=frozenset()) -> bool:
    """Whether every one of ``columns`` fits ``fit_width()`` (always where text does not wrap)."""
    return not wraps_text() or _width(_column_widths(columns, table_cells(rows), text_columns)[1]) <= fit_width()


def print_table(
    columns: list[str],
    rows: list[tuple],
    *,
    title: str | None = None,
    fit: bool = True,
    drop: bool = True,
    pinned: int = 1,
    text_columns: set[str] = frozenset(),  # type: ignore[assignment]  # read only
    available: int | None = None,
    yields: Sequence[str] = (),
    more: str | None = None,
) -> list[str]:
    """Print rows as a table whose headers and numbers never break. ``fit``: stay within
    ``fit_width()`` — text columns wrap first, then (``drop``) columns are left out, those named
    in ``yields`` first (in that order: the least informative first), then from the right (never
    the first ``pinned``), and a line names them; else the table takes its natural width. Where
    even that is too wide, words break: the longest first (paths), names only when nothing else
    is left. ``available``: how many columns the rows had (a line says how to see the others);
    ``more``: how to see the columns left out, where the command has no --columns and --wide.
    Returns the columns left out."""
    cells = table_cells(rows)
    if fit and not wraps_text():
        # piped without $COLUMNS: every column asked for, and rows whole (one row, one line to
        # grep) but where a column holds prose (definitions, messages): it wraps at FIT_WIDTH,
        # as `metrics | head` or a pager shows it; names and paths never break
        drop = False
        text_columns = {c for i, c in enumerate(columns) if c in text_columns and any(" " in r[i].plain for r in cells)}
        fit = bool(text_columns)
    natural, least = _column_widths(columns, cells, text_columns)
    keep = list(range(len(columns)))
    width = fit_width()
    left_out: list[str] = []
    if fit and drop:
        order = [columns.index(c) for c in yields if c in columns and columns.index(c) >= pinned]
        order += [i for i in reversed(keep) if i >= pinned and i not in order]
        while order and _width(least[i] for i in keep) > width:
            keep.remove(order.pop(0))
        left_out = [c for i, c in enumerate(columns) if i not in keep]
    if fit and _width(least[i] for i in keep) > width:  # then words break too, the longest first …
        least = _break_words(columns, natural, least, keep, text_columns, width)
    if fit and _width(least[i] for i in keep) > width:  # … or, when even that is too wide, the terminal wraps
        fit = False
    total = _width(natural[i] for i in keep)
    if title is not None:
        print_wrapped(title)
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        header_style="bold",
    )
    for i in keep:
        wraps = columns[i] in text_columns
        table.add_column(Text(str(columns[i])), no_wrap=not wraps, overflow="fold", min_width=least[i])
    for row in cells:
        table.add_row(*(row[i] for i in keep))
    with console_width(min(total, width) if fit else max(total, 20)):
        print_trimmed(table)
    if left_out:
        if more is None:
            more = "--columns picks, --wide shows all" if available is not None else ""
        named = (
            ", ".join(left_out) if len(left_out) <= 10 else f"{', '.join(left_out[:6])} and {len(left_out) - 6} more"
        )
        print_note(f"left out to fit {width} characters: {named}" + (f" ({more})" if more else ""))
    elif available is not None and available > len(keep):
        print_note(f"{len(keep)} of {available} columns (--columns picks, --wide shows all; csv/json have all)")
    return left_out
