"""What every question of the Python API returns: a ``Table`` over an Arrow table, with its notes."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa

if TYPE_CHECKING:
    import pandas


def table(columns: list[str], rows: list[tuple]) -> pa.Table:
    """Query rows as an Arrow table (types inferred per column; None is null)."""
    return pa.table({c: pa.array([r[i] for r in rows]) for i, c in enumerate(columns)})


class Table:
    """The rows of one question. ``.df()``: a pandas DataFrame; ``.arrow``: the Arrow table, which
    the object also reads as (``num_rows``, ``column_names``, ``column("x")``, ``to_pylist()``,
    ``len(t)``, ``t["x"]``; and any library that takes Arrow data: ``polars.DataFrame(t)``,
    ``pa.table(t)``). ``.notes``: what its numbers are measured against and how its intervals
    were made, as under a CLI table (also in the Arrow schema's metadata, ``headatlas.notes``)."""

    def __init__(self, arrow: pa.Table, *, what: str, notes: Sequence[str] = ()) -> None:
        self.what = what
        self.notes = tuple(n for n in notes if n)
        meta = {b"headatlas.notes": "\n".join(self.notes).encode()} if self.notes else None
        self.arrow = arrow.replace_schema_metadata(meta) if meta else arrow

    @classmethod
    def of(cls, columns: list[str], rows: list[tuple], *, what: str, notes: Sequence[str] = ()) -> Table:
        """A table of query rows (``columns``, ``rows`` as the query functions return them)."""
        return cls(table(columns, rows), what=what, notes=notes)

    def df(self, *, all_columns: bool = False) -> pandas.DataFrame:
        """The rows as a pandas DataFrame (its ``attrs["notes"]``: ``.notes``). Chance columns that
        hold one value on every row (``within_sentence_chance``: the run's, the same for each head)
        are left out, with their intervals, so that the columns that answer come first; their
        values are in ``attrs["constant"]`` and a note. ``all_columns=True``: every column, as
        ``.arrow`` has them. Needs pandas: ``pip install 'headatlas[pandas]'``."""
        try:
            import pandas  # noqa: F401
        except ImportError:
            raise ImportError(
                "Table.df() needs pandas: pip install 'headatlas[pandas]' (or read .arrow, the Arrow table)"
            ) from None
        constant = {} if all_columns else self.constant_chances()
        frame = self.arrow.drop_columns(_with_bounds(self.arrow.column_names, constant)).to_pandas()
        frame.attrs["notes"] = list(self.notes) + ([_constant_note(constant)] if constant else [])
        frame.attrs["constant"] = constant
        return frame

    def constant_chances(self) -> dict[str, object]:
        """The chance columns (``…_chance``) equal on every row, name to value: what ``df()``
        leaves out. None where the table has fewer than two rows (one row says nothing of that)."""
        if self.arrow.num_rows < 2:
            return {}
        found = {}
        for name in self.arrow.column_names:
            if not name.endswith("_chance"):
                continue
            values = set(self.arrow.column(name).to_pylist())
            if len(values) == 1:
                found[name] = values.pop()
        return found

    def to_pandas(self) -> pandas.DataFrame:
        """The same as ``df()`` (pyarrow's name for it)."""
        return self.df()

    def to_pylist(self) -> list[dict]:
        """The rows as dicts, column name to value."""
        return self.arrow.to_pylist()

    def __len__(self) -> int:
        return self.arrow.num_rows

    def __getitem__(self, key):
        return self.arrow[key]

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "arrow":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.arrow, name)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | {n for n in dir(self.arrow) if not n.startswith("_")})

    def __arrow_c_stream__(self, requested_schema=None):
        return self.arrow.__arrow_c_stream__(requested_schema)

    def __repr__(self) -> str:
        # the columns df() gives, and why the others are not among them: repr and df() agree
        left_out = _with_bounds(self.arrow.column_names, self.constant_chances())
        shown = self.arrow.num_columns - len(left_out)
        why = (
            f" ({len(left_out)} more in .arrow and df(all_columns=True): chance columns equal on every row)"
            if left_out
            else ""
        )
        return f"<Table {self.what}: {self.arrow.num_rows:,} rows × {shown} columns{why}>"

    def __str__(self) -> str:
        """The table as text, as pandas prints a frame: the first and last rows of the columns
        ``df()`` gives (those that fit ``TEXT_WIDTH`` characters), how many are not shown, then the
        notes. ``print(table)`` in a script or a terminal."""
        constant = self.constant_chances()
        arrow = self.arrow.drop_columns(_with_bounds(self.arrow.column_names, constant))
        n = arrow.num_rows
        if n > TEXT_ROWS:
            picked = [*range(TEXT_ROWS // 2), *range(n - TEXT_ROWS // 2, n)]
            records = arrow.take(picked).to_pylist()
        else:
            records = arrow.to_pylist()
        columns: list[str] = []
        widths: list[int] = []
        for name in arrow.column_names:
            width = max([len(name), *(len(_cell(r[name])) for r in records)])
            if sum(widths) + 2 * len(widths) + width > TEXT_WIDTH and columns:
                break
            columns.append(name)
            widths.append(width)
        hidden = arrow.num_columns - len(columns)

        def line(cells: list[str]) -> str:
            text = "  ".join(c.rjust(w) for c, w in zip(cells, widths))
            return f"{text}  …" if hidden else text.rstrip()

        lines = [repr(self), line(columns)]
        for i, record in enumerate(records):
            if n > TEXT_ROWS and i == TEXT_ROWS // 2:
                lines.append(line(["…"] * len(columns)))
            lines.append(line([_cell(record[c]) for c in columns]))
        if n > TEXT_ROWS or hidden:
            lines.append(
                f"[{len(records)} of {n:,} rows, {len(columns)} of {arrow.num_columns} columns shown: .df() or .arrow has all]"
            )
        if constant:
            lines.append(_constant_note(constant))
        return "\n".join([*lines, *self.notes])

    def _repr_html_(self) -> str:
        """A notebook's view: the table's size, the first ``HTML_ROWS`` rows of the columns
        ``df()`` gives, how many rows and columns are not shown, then the notes."""
        constant = self.constant_chances()
        shown = self.arrow.slice(0, HTML_ROWS).drop_columns(_with_bounds(self.arrow.column_names, constant))
        try:
            import pandas

            body = shown.to_pandas().to_html(
                max_rows=HTML_ROWS,
                max_cols=pandas.get_option("display.max_columns"),
                show_dimensions=False,  # the size is said once, above, of the whole table
                notebook=True,
                na_rep="",
            )
        except ImportError:
            head = "".join(f"<th>{html.escape(c)}</th>" for c in shown.column_names)
            rows = "".join(
                "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row.values()) + "</tr>"
                for row in shown.to_pylist()
            )
            body = f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
        left = []
        if self.arrow.num_rows > HTML_ROWS:
            left.append(f"… {self.arrow.num_rows - HTML_ROWS:,} more rows (the first {HTML_ROWS} shown)")
        if constant:
            left.append(_constant_note(constant))
        more = "".join(f"<p>{html.escape(line)}</p>" for line in left)
        notes = "".join(f"<p><small>{html.escape(n)}</small></p>" for n in self.notes)
        return f"<p>{html.escape(repr(self))}</p>{body}{more}{notes}"


HTML_ROWS = 20  # rows a notebook's view shows
TEXT_ROWS = 10  # rows str() shows: the first and the last five
TEXT_WIDTH = 100  # characters of the columns str() shows


def _with_bounds(columns: list[str], names) -> list[str]:
    """``names`` and their interval bounds (``name_lo``, ``name_hi``) among ``columns``."""
    chosen = {n for name in names for n in (name, f"{name}_lo", f"{name}_hi")}
    return [c for c in columns if c in chosen]


def _constant_note(constant: dict) -> str:
    values = ", ".join(f"{name} = {_cell(value)}" for name, value in constant.items())
    return f"{len(constant)} chance column(s) equal on every row, left out (df(all_columns=True) keeps them): {values}"


def _cell(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else "" if value is None else str(value)
