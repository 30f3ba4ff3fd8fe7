"""Rendering shared by every command: --format table|csv|json, sparklines, errors."""

from __future__ import annotations

import csv
import json
import math
import sys
from datetime import date, datetime
from enum import Enum
from typing import TYPE_CHECKING

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
) -> None:
    if fmt == Format.json:
        data = [{c: _json_value(v) for c, v in zip(columns, row)} for row in rows]
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    elif fmt == Format.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else _json_value(v) for v in row])
    else:
        table = Table(title=Text(title) if title is not None else None, show_lines=False, header_style="bold")
        for column in columns:
            table.add_column(Text(str(column)), overflow="fold")
        for cells in _cells(rows):
            table.add_row(*cells)
        stdout.print(table)
    if truncated:
        stderr.print(
            Text(f"truncated: showing the first {len(rows)} rows; narrow the query or raise --max-rows", style="yellow")
        )


def render_record(record: dict, fmt: Format = Format.table, *, title: str | None = None) -> None:
    """One record: one JSON object with named fields, or field/value rows (table, csv)."""
    if fmt == Format.json:
        data = {k: _json_value(v) for k, v in record.items()}
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render(["field", "value"], [(k, v) for k, v in record.items()], fmt, title=title)


def merge_intervals(
    columns: list[str], rows: list[tuple], keep: list[str] | None = None
) -> tuple[list[str], list[tuple]]:
    """For tables: ``x``, ``x_lo``, ``x_hi`` become one cell "x [lo, hi]"; ``keep``: the columns
    to show (others dropped), in order."""
    index = {c: i for i, c in enumerate(columns)}
    shown = [c for c in (keep or columns) if c in index and not (c.endswith(("_lo", "_hi")) and c[:-3] in index)]
    out_rows = []
    for row in rows:
        cells = []
        for c in shown:
            value = row[index[c]]
            lo, hi = index.get(f"{c}_lo"), index.get(f"{c}_hi")
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
) -> None:
    """Metric rows: every column in JSON and CSV; in a table the ``table_columns`` (all by
    default) with intervals folded into their cells, and ``note`` (what a lift is measured
    against) printed under it, then the intervals' footnote naming their replicate scheme (SPEC
    §5d): the rows' ``interval_by`` column, else ``schemes`` (the runs'). Rows with intervals but
    no ``interval_by`` gain that column from ``schemes``, so JSON and CSV name it too."""
    has_intervals = any(c.endswith("_lo") for c in columns)
    if has_intervals and "interval_by" not in columns and schemes:
        columns, rows = [*columns, "interval_by"], [(*r, " / ".join(sorted(set(schemes)))) for r in rows]
    if fmt != Format.table:
        render(columns, rows, fmt, title=title)
        return
    shown = [c for c in (table_columns or columns) if c != "interval_by"]
    shown, cells = merge_intervals(columns, rows, shown)
    render(shown, cells, fmt, title=title)
    if note:
        stdout.print(note, style="dim", highlight=False, markup=False)
    if has_intervals:
        from headatlas.service.reports.intervals import interval_note

        if "interval_by" in columns:
            at = columns.index("interval_by")
            schemes = [part for r in rows if r[at] for part in str(r[at]).split(" / ")]
        stdout.print(interval_note(schemes or []), style="dim", highlight=False, markup=False)


def sparkline(values: list[float], *, top: float | None = None) -> str:
    clean = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    top = max(clean, default=0.0) if top is None else top
    if top <= 0:
        return SPARK[0] * len(clean)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in clean)


def error(message: str) -> None:
    """The CLI's one error line: messages that span lines (a driver's) are joined."""
    line = " ".join(part.strip() for part in str(message).splitlines() if part.strip())
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
