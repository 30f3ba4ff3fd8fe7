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


def sparkline(values: list[float], *, top: float | None = None) -> str:
    clean = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    top = max(clean, default=0.0) if top is None else top
    if top <= 0:
        return SPARK[0] * len(clean)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in clean)


def error(message: str) -> None:
    stderr.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
