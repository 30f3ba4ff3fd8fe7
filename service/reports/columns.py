"""The columns ``query heads`` returns and may sort by, from the metric declarations alone (no
database code), so that ``--help`` can list them without importing the queries."""

from __future__ import annotations

from headatlas.service.metrics import COLUMNS

# the columns of head_metrics that `query heads` shows, as declared (service.metrics)
HEAD_COLUMNS = ("layer", "head", *(c.name for c in COLUMNS if c.heads), "windows")
# the synthetic probe (SPEC §8): its own table, NULL for a run without one
PROBE_COLUMNS = ("induction_score", "duplicate_score", "prev_token_score")
SORTABLE = HEAD_COLUMNS[2:] + PROBE_COLUMNS
