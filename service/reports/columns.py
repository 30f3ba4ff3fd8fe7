"""The columns ``query heads`` returns and may sort by, and the default head tables' columns, from
the metric declarations alone (no database code), so that ``--help`` can list them without
importing the queries.

The constants are headatlas's own columns (``--help`` and the docs list them whatever is
installed); the functions add the installed plugins' head columns (``metrics.all_columns``),
which every front end reads through ``queries.heads``: the command line, the Python API and the
web page."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from headatlas.service.errors import Param, ParameterError
from headatlas.service.metrics import COLUMNS, Column, Shown, all_columns

# the columns of head_metrics that `query heads` shows, as declared (service.metrics)
HEAD_COLUMNS = ("layer", "head", *(c.name for c in COLUMNS if c.heads), "windows")
# the synthetic probe (SPEC §8): its own table, NULL for a run without one
PROBE_COLUMNS = ("induction_score", "duplicate_score", "prev_token_score")
SORTABLE = HEAD_COLUMNS[2:] + PROBE_COLUMNS


def head_columns() -> tuple[str, ...]:
    """HEAD_COLUMNS with the installed plugins' head columns after headatlas's (before ``windows``)."""
    return ("layer", "head", *(c.name for c in all_columns() if c.heads), "windows")


def sortable() -> tuple[str, ...]:
    """SORTABLE with the installed plugins' head columns: what ``--sort`` (``?sort=``, ``sort=``) takes."""
    return head_columns()[2:] + PROBE_COLUMNS


def _table(columns: Sequence[Column], terminal: bool) -> list[str]:
    kinds = (Shown.TERMINAL,) if terminal else (Shown.PAGE, Shown.TERMINAL)
    return ["layer", "head", *(c.name for c in columns if c.heads and c.shown in kinds)]


# `query heads`' table of headatlas's own columns (the one list is the declarations' ``shown``)
TERMINAL_HEAD_TABLE = _table(COLUMNS, True)


def head_table(
    *,
    terminal: bool = False,
    sort: str | None = None,
    among: Sequence[str] | None = None,
    rows: Sequence[Sequence] | None = None,
) -> list[str]:
    """The columns a head table shows by default, the installed plugins' included (declared with
    ``shown``): ``layer``, ``head`` and those of the web page and the report, or (``terminal``) of
    ``query heads``' narrower table; ``sort``, where it is not among them, third; ``among``: only
    the columns a query returned, and with its ``rows``, not a plugin's column the run holds no
    value of (a run analysed without the plugin's measure: a blank column on every run)."""
    table = _table(all_columns(), terminal)
    if sort is not None and sort not in table:
        table = [*table[:2], sort, *table[2:]]
    if among is None:
        return table
    own = set(HEAD_COLUMNS) | set(PROBE_COLUMNS)

    def blank(c: str) -> bool:
        i = list(among).index(c)
        return rows is not None and c not in own and c != sort and all(r[i] is None for r in rows)

    return [c for c in table if c in among and not blank(c)]


def unknown_metric(
    parameter: str, value: str, allowed: Sequence[str], *, what: str = "a metric here"
) -> ParameterError:
    """The one-line refusal of a metric name not in ``allowed`` (``parameter``: the option that
    named it, e.g. ``sort``): the closest names, not the whole list (forty names and more), which
    ``headatlas metrics`` shows with what each means."""
    close = difflib.get_close_matches(value, allowed, n=3)
    named = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else "".join(close)
    hint = f"did you mean {named}? " if close else ""
    return ParameterError(
        Param(parameter, value, quoted=True), f": not {what}", hint=f"{hint}`headatlas metrics` lists every metric"
    )
