"""--format table|csv|json: rows and records written as each format has them, and the columns a
table shows (``--columns``, ``--wide``)."""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from enum import Enum

from rich.text import Text

from headatlas.cli.console import stderr
from headatlas.cli.tables import all_text_columns, print_table
from headatlas.service.json_values import jsonable


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
    left_out_hint: str | None = None,
) -> None:
    """Rows as a table, CSV or JSON. ``view`` (``--columns``/``--wide``): what a table shows; by
    default ``table_columns`` (all when None) fitted to the width (``fit_width``) by leaving out
    columns from the right, never the first ``pinned``; without ``view`` every column, its text
    wrapped to fit. ``text_columns``: those that may wrap (default: the columns whose values are
    all text); headers and numbers never break. ``left_out_hint`` (without ``view``): columns
    are left out from the right too where the table does not fit, and a line names them and
    says how to see them."""
    if view is not None and view.picked is not None:
        view.check(columns)
        index = [columns.index(c) for c in view.picked]
        columns, rows = list(view.picked), [tuple(r[i] for i in index) for r in rows]
    if fmt == Format.json:
        data = [{c: jsonable(v) for c, v in zip(columns, row)} for row in rows]
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    elif fmt == Format.csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow(["" if v is None else jsonable(v) for v in row])
    else:
        if text_columns is None:
            text_columns = all_text_columns(columns, rows)
        if view is not None and view.wide:  # all of them, at their width
            print_table(columns, rows, title=title, fit=False, text_columns=text_columns)
        elif view is None and left_out_hint is not None:  # text wraps, then columns are left out
            print_table(columns, rows, title=title, text_columns=text_columns, more=left_out_hint)
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


def render_record(record: dict, fmt: Format = Format.table, *, title: str | None = None) -> None:
    """One record: one JSON object with named fields, or field/value rows (table, csv)."""
    if fmt == Format.json:
        data = {k: jsonable(v) for k, v in record.items()}
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        render(["field", "value"], [(k, v) for k, v in record.items()], fmt, title=title)
