"""Values as the commands show them: a table's cells (numbers to four significant figures or
whole thousands, dates in ISO form, long values cut to keep a table printable) and JSON's and
CSV's values (NaN and infinities as null, numpy scalars as numbers)."""

from __future__ import annotations

import math
from datetime import date, datetime

from rich.text import Text

# Tables are cut to this many characters of cells (the whole values are in --format csv/json):
# rich lays out ~2 MB/s, so a 20 MB value, or 1000 rows of 40 KB, would print long past --timeout.
MAX_CELL_CHARS = 2000
MAX_TABLE_CHARS = 200_000


def _cell(text: str, limit: int) -> Text:
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text):,} characters; --format csv shows all)"
    return Text(text)


def table_cells(rows: list[tuple]) -> list[list[Text]]:
    """Rows as Text cells, each cut so that the table stays within MAX_TABLE_CHARS."""
    texts = [[cell_text(v) for v in row] for row in rows]
    count = sum(len(row) for row in texts) or 1
    total = sum(min(len(t), MAX_CELL_CHARS) for row in texts for t in row)
    limit = MAX_CELL_CHARS if total <= MAX_TABLE_CHARS else max(20, MAX_TABLE_CHARS // count)
    return [[_cell(t, limit) for t in row] for row in texts]


def cell_text(value) -> str:
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
