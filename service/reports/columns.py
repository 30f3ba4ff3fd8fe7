"""The columns ``query heads`` returns and may sort by, from the metric declarations alone (no
database code), so that ``--help`` can list them without importing the queries."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from headatlas.service.errors import Param, ParameterError
from headatlas.service.metrics import COLUMNS

# the columns of head_metrics that `query heads` shows, as declared (service.metrics)
HEAD_COLUMNS = ("layer", "head", *(c.name for c in COLUMNS if c.heads), "windows")
# the synthetic probe (SPEC §8): its own table, NULL for a run without one
PROBE_COLUMNS = ("induction_score", "duplicate_score", "prev_token_score")
SORTABLE = HEAD_COLUMNS[2:] + PROBE_COLUMNS


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
