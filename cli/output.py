"""Rendering shared by every command: --format table|csv|json, sparklines, errors."""

from __future__ import annotations

import csv
import json
import math
import os
import shlex
import shutil
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import date, datetime
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:  # rich.progress is imported by the commands that draw a bar
    from rich.progress import Progress

# Piped output is not wrapped at 80 columns: tables stay one row per line.
# markup=False: run, schedule and file names are data; a name such as "a[/x]" must print as
# written, not be read as a style tag (which raises MarkupError). Styled text is built as Text.
stdout = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 250, markup=False)
stderr = Console(stderr=True, markup=False)

# Tables are cut to this many characters of cells (the whole values are in --format csv/json):
# rich lays out ~2 MB/s, so a 20 MB value, or 1000 rows of 40 KB, would print long past --timeout.
MAX_CELL_CHARS = 2000
MAX_TABLE_CHARS = 200_000

SPARK = "▁▂▃▄▅▆▇█"

# Tables fit a terminal's width, or $COLUMNS; each command's default columns are chosen to fit
# this many characters (the width tables fit when $COLUMNS says nothing else).
FIT_WIDTH = 100
MIN_TEXT_WIDTH = 20  # a text column (anchors, definitions, paths) may wrap down to this width …
MAX_WORD_WIDTH = 40  # … or to its longest word, up to this (a longer one, a path, breaks anywhere)


@dataclass(frozen=True)
class TableView:
    """The columns a table shows: ``picked`` (``--columns``), every one (``wide``, ``--wide``),
    or the command's default set, fitted to the width. ``picked`` applies to CSV and JSON too."""

    picked: tuple[str, ...] | None = None
    wide: bool = False

    @classmethod
    def of(cls, columns: str | None, wide: bool = False) -> TableView:
        picked = tuple(c.strip() for c in columns.split(",") if c.strip()) if columns is not None else None
        if picked is not None and not picked:
            from headatlas.service.errors import ParameterError

            raise ParameterError("--columns is empty: pass names separated by commas, e.g. --columns layer,head")
        return cls(picked, wide)

    def check(self, available: list[str]) -> None:
        """Refuse a picked name that is not one of ``available``, in one line that lists them."""
        from headatlas.service.errors import ParameterError

        unknown = [c for c in self.picked or () if c not in available]
        if unknown:
            raise ParameterError(
                f"--columns {','.join(unknown)}: not a column here; choose from {', '.join(available)}"
            )


DEFAULT_VIEW = TableView()


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


def _cell(text: str, limit: int) -> Text:
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text):,} characters; --format csv shows all)"
    return Text(text)


def _cells(rows: list[tuple]) -> list[list[Text]]:
    """Rows as Text cells, each cut so that the table stays within MAX_TABLE_CHARS."""
    texts = [[_cell_text(v) for v in row] for row in rows]
    count = sum(len(row) for row in texts) or 1
    total = sum(min(len(t), MAX_CELL_CHARS) for row in texts for t in row)
    limit = MAX_CELL_CHARS if total <= MAX_TABLE_CHARS else max(20, MAX_TABLE_CHARS // count)
    return [[_cell(t, limit) for t in row] for row in texts]


def _cell_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0 or 0.001 <= abs(value) < 10_000:
            return f"{value:.4g}"
        if abs(value) >= 10_000:
            return f"{value:,.0f}"
        return f"{value:.3e}"
    if isinstance(value, (datetime, date)):
        return value.isoformat(sep=" ", timespec="seconds") if isinstance(value, datetime) else value.isoformat()
    return str(value)


def _json_value(value):
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if hasattr(value, "item"):
        return value.item()
    return value


def render(
    columns: list[str],
    rows: list[tuple],
    fmt: Format = Format.table,
    *,
    title: str | None = None,
    truncated: bool = False,
    view: TableView | None = None,
    table_columns: list[str] | None = None,
    pinned: int = 1,
    text_columns: set[str] | None = None,
) -> None:
    """Rows as a table, CSV or JSON. ``view`` (``--columns``/``--wide``): what a table shows; by
    default ``table_columns`` (all when None) fitted to the width (``fit_width``) by leaving out
    columns from the right, never the first ``pinned``; without ``view`` every column, its text
    wrapped to fit. ``text_columns``: those that may wrap (default: the columns whose values are
    all text); headers and numbers never break."""
    if view is not None and view.picked is not None:
        view.check(columns)
        index = [columns.index(c) for c in view.picked]
        columns, rows = list(view.picked), [tuple(r[i] for i in index) for r in rows]
    if fmt == Format.json:
        data = [{c: _json_value(v) for c, v in zip(columns, row)} for row in rows]
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    elif fmt == Format.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else _json_value(v) for v in row])
    else:
        if text_columns is None:
            text_columns = _text_columns(columns, rows)
        if view is not None and view.wide:  # all of them, at their width
            print_table(columns, rows, title=title, fit=False, text_columns=text_columns)
        elif view is None or view.picked is not None:  # these columns: text wraps, none is left out
            print_table(columns, rows, title=title, drop=False, text_columns=text_columns)
        else:
            shown = [c for c in (table_columns or columns) if c in columns]
            index = [columns.index(c) for c in shown]
            print_table(
                shown,
                [tuple(r[i] for i in index) for r in rows],
                title=title,
                fit=True,
                pinned=pinned,
                text_columns=text_columns,
                available=len(columns),
            )
    if truncated:
        stderr.print(
            Text(f"truncated: showing the first {len(rows)} rows; narrow the query or raise --max-rows", style="yellow")
        )


def _text_columns(columns: list[str], rows: list[tuple]) -> set[str]:
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


def fit_width() -> int:
    """The width tables fit: the terminal's, else $COLUMNS, else FIT_WIDTH."""
    if stdout.is_terminal:
        return stdout.size.width
    try:
        return max(20, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return FIT_WIDTH


def wraps_text() -> bool:
    """Whether output fits ``fit_width()`` (tables leave columns out and wrap text, titles and
    notes wrap): on a terminal or with $COLUMNS set. Piped without it, every line stays whole
    (one note, one row: one line to grep), and tables show their default columns."""
    return stdout.is_terminal or bool(os.environ.get("COLUMNS", "").strip())


@contextmanager
def _console_width(width: int) -> Iterator[None]:
    before = stdout._width  # None: the terminal's, or rich's default
    stdout.width = width
    try:
        yield
    finally:
        stdout._width = before


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


def fits(columns: list[str], rows: list[tuple], text_columns=frozenset()) -> bool:
    """Whether every one of ``columns`` fits ``fit_width()`` (always where text does not wrap)."""
    return not wraps_text() or _width(_column_widths(columns, _cells(rows), text_columns)[1]) <= fit_width()


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
) -> None:
    """Print rows as a table whose headers and numbers never break. ``fit``: stay within
    ``fit_width()`` — text columns wrap first, then (``drop``) columns are left out from the
    right (never the first ``pinned``) and a line names them; else the table takes its natural
    width. ``available``: how many columns the rows had (a line says how to see the others)."""
    cells = _cells(rows)
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
        while len(keep) > pinned and _width(least[i] for i in keep) > width:
            left_out.insert(0, columns[keep.pop()])
    if fit and _width(least[i] for i in keep) > width:  # then words break too …
        least = [min(w, max(MIN_TEXT_WIDTH, len(c))) if c in text_columns else w for c, w in zip(columns, natural)]
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
    with _console_width(min(total, width) if fit else max(total, 20)):
        _print_trimmed(table)
    if left_out:
        more = " (--columns picks, --wide shows all)" if available is not None else ""
        print_note(f"left out to fit {width} characters: {', '.join(left_out)}{more}")
    elif available is not None and available > len(keep):
        print_note(f"{len(keep)} of {available} columns (--columns picks, --wide shows all; csv/json have all)")


def render_record(record: dict, fmt: Format = Format.table, *, title: str | None = None) -> None:
    """One record: one JSON object with named fields, or field/value rows (table, csv)."""
    if fmt == Format.json:
        data = {k: _json_value(v) for k, v in record.items()}
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render(["field", "value"], [(k, v) for k, v in record.items()], fmt, title=title)


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
                cells.append(f"{_cell_text(value)} [{_cell_text(row[lo])}, {_cell_text(row[hi])}]")
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
    ``--columns``, CSV and JSON)."""
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
    text = _text_columns(columns, rows)
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


def print_note(text: str) -> None:
    """A dim line under a table, wrapped at the width tables fit (``wraps_text``)."""
    print_wrapped(text, style="dim")


def _print_trimmed(renderable, *, soft_wrap: bool = False) -> None:
    """Print without the spaces rich pads lines with, unless the output is a terminal (where they
    do not show, and cutting them could cut a style's codes): files and pipes get clean lines."""
    if stdout.is_terminal:
        stdout.print(renderable, highlight=False, soft_wrap=soft_wrap)
        return
    with stdout.capture() as captured:
        stdout.print(renderable, highlight=False, soft_wrap=soft_wrap)
    stdout.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def print_wrapped(text: str, *, style: str = "") -> None:
    """A line of text beside a table (a title, a summary), wrapped at the width tables fit where
    text wraps (``wraps_text``), else left whole."""
    if not wraps_text():
        _print_trimmed(Text(text, style=style), soft_wrap=True)
        return
    with _console_width(fit_width()):
        _print_trimmed(Text(text, style=style))


def note(text: str) -> None:
    """A ``note: …`` line on stderr, its quoted commands spelled as they are typed here
    (``said``: wrapped to a terminal, whole elsewhere)."""
    said(runnable(f"note: {text}"))


def said(text: str) -> None:
    """A note or warning on stderr: wrapped between words at the terminal's width when stderr is
    a terminal; whole (one line, to grep) when it is a file or a pipe."""
    stderr.print(text, markup=False, highlight=False, soft_wrap=not stderr.is_terminal)


def sparkline(values: list[float], *, top: float | None = None) -> str:
    """Bars from 0 to ``top`` (default the largest value): for shares and counts, whose 0 means
    something (a distance profile)."""
    clean = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    top = max(clean, default=0.0) if top is None else top
    if top <= 0:
        return SPARK[0] * len(clean)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in clean)


def range_sparkline(values: list[float | None]) -> str:
    """Bars from the values' own minimum to their maximum: for a series that moves far from 0 (a
    lift of 1.035 → 1.015 would draw two full bars from 0). A missing value is a space; a series
    that does not move is drawn at mid height."""
    clean = [None if v is None or math.isnan(float(v)) else float(v) for v in values]
    present = [v for v in clean if v is not None]
    low, high = min(present, default=0.0), max(present, default=0.0)
    if high <= low:
        return "".join(" " if v is None else SPARK[len(SPARK) // 2 - 1] for v in clean)
    top = len(SPARK) - 1
    return "".join(" " if v is None else SPARK[int((v - low) / (high - low) * top + 0.5)] for v in clean)


def trend_line(metric: str, values: list[float | None]) -> str:
    """``query trend``'s line under its table: the sparkline and the range it spans."""
    present = [v for v in values if v is not None and not math.isnan(float(v))]
    return f"{metric} {range_sparkline(values)}  ({min(present, default=0):.4g} … {max(present, default=0):.4g})"


def command_name() -> str:
    """How headatlas is typed here: ``headatlas`` when that is on PATH (and is this program), else
    the path this process was started by, e.g. ``.venv/bin/headatlas`` after ``make demo`` in a
    shell where the virtual environment is not activated."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is None or script.name != "headatlas" or not script.is_file():
        return "headatlas"  # the console script was not how this process started (tests, python -m)
    found = shutil.which("headatlas")
    try:
        if found and os.path.samefile(found, script):
            return "headatlas"
    except OSError:
        pass
    path = os.path.relpath(script.absolute())
    if path.startswith(".."):
        path = str(script.absolute())
    elif os.sep not in path:
        path = os.path.join(".", path)
    return shlex.quote(path)


def runnable(text: str) -> str:
    """``text`` with every quoted command (`headatlas …`) spelled as it is typed here."""
    name = command_name()
    return text if name == "headatlas" else text.replace("`headatlas ", f"`{name} ")


def error(message: str) -> None:
    """The CLI's one error line: messages that span lines (a driver's) are joined; the commands
    it quotes are spelled as they are typed here (``runnable``)."""
    line = runnable(" ".join(part.strip() for part in str(message).splitlines() if part.strip()))
    stderr.print(Text.assemble(("error:", "bold red"), " ", line), highlight=False, soft_wrap=True)


def progress_bar(what: str, count: str) -> Progress:
    """A progress bar on stderr, as analyze and submit --wait show it: ``what``, the bar, its
    percentage, ``count`` (a column over the task's fields), windows/s (the ``rate`` field),
    elapsed time and ETA."""
    from rich.progress import (
        BarColumn,
        Progress,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn(what),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn(count),
        TextColumn("{task.fields[rate]:.1f} windows/s"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=stderr,
    )
