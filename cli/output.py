"""Rendering shared by every command: --format table|csv|json, sparklines, errors."""

from __future__ import annotations

import csv
import json
import math
import sys
from datetime import date, datetime
from enum import Enum

from rich.console import Console
from rich.table import Table

# Piped output is not wrapped at 80 columns: tables stay one row per line.
stdout = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 250)
stderr = Console(stderr=True)

SPARK = "▁▂▃▄▅▆▇█"


class Format(str, Enum):
    table = "table"
    csv = "csv"
    json = "json"


def _cell(value) -> str:
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
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if hasattr(value, "item"):
        return value.item()
    return value


def render(columns: list[str], rows: list[tuple], fmt: Format = Format.table, *, title: str | None = None,
           truncated: bool = False) -> None:
    if fmt == Format.json:
        data = [{c: _json_value(v) for c, v in zip(columns, row)} for row in rows]
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    elif fmt == Format.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else _json_value(v) for v in row])
    else:
        table = Table(title=title, show_lines=False, header_style="bold")
        for column in columns:
            table.add_column(column, overflow="fold")
        for row in rows:
            table.add_row(*(_cell(v) for v in row))
        stdout.print(table)
    if truncated:
        stderr.print(f"[yellow]truncated: showing the first {len(rows)} rows; narrow the query or raise --max-rows[/]")


def merge_intervals(columns: list[str], rows: list[tuple], keep: list[str] | None = None) -> tuple[list[str], list[tuple]]:
    """For tables: ``x``, ``x_lo``, ``x_hi`` become one cell "x [lo, hi]"; ``keep``: the columns
    to show (others dropped), in order."""
    index = {c: i for i, c in enumerate(columns)}
    shown = [c for c in (keep or columns) if c in index and not (
        c.endswith(("_lo", "_hi")) and c[:-3] in index)]
    out_rows = []
    for row in rows:
        cells = []
        for c in shown:
            value = row[index[c]]
            lo, hi = index.get(f"{c}_lo"), index.get(f"{c}_hi")
            if lo is not None and hi is not None and value is not None and row[lo] is not None:
                cells.append(f"{_cell(value)} [{_cell(row[lo])}, {_cell(row[hi])}]")
            else:
                cells.append(value)
        out_rows.append(tuple(cells))
    return shown, out_rows


def render_metrics(columns: list[str], rows: list[tuple], fmt: Format, *, title: str | None = None,
                   table_columns: list[str] | None = None, note: str | None = None) -> None:
    """Metric rows: every column in JSON and CSV; in a table the ``table_columns`` (all by
    default) with intervals folded into their cells, and ``note`` (what a lift is measured
    against) printed under it."""
    if fmt != Format.table:
        render(columns, rows, fmt, title=title)
        return
    shown, cells = merge_intervals(columns, rows, table_columns)
    render(shown, cells, fmt, title=title)
    if note:
        stdout.print(note, style="dim", highlight=False, markup=False)
    if any(c.endswith("_lo") for c in columns):
        stdout.print("[a, b]: 95% interval, delete-one-group jackknife over 16 replicate groups of windows "
                     "(SPEC §5b); it covers the sampling of windows, not the choice of model or parameters.",
                     style="dim", highlight=False, markup=False)


def sparkline(values: list[float], *, top: float | None = None) -> str:
    clean = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    top = max(clean, default=0.0) if top is None else top
    if top <= 0:
        return SPARK[0] * len(clean)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in clean)


def error(message: str) -> None:
    stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
