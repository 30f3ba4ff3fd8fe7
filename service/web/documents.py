"""JSON and CSV documents of query rows, as ``headatlas … --format json|csv`` writes them.

Rows become objects named by their columns (the SPEC's names); a NaN or infinity is null, a time
is its ISO text, a numpy scalar its Python value, and anything else JSON has no type for is its
text. Tables with intervals name their replicate scheme in ``interval_by`` (``with_scheme``), as
the CLI's tables do. tests/test_web.py checks each page's document against the CLI's own output.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from headatlas.service.json_values import jsonable

Rows = tuple[list[str], list[tuple]]


# the fields of a run in `headatlas runs --format json`, in its order (a lake adds its last snapshot)
RUN_FIELDS = (
    "run_id",
    "name",
    "status",
    "snapshot",
    "windows",
    "model",
    "aliases",
    "tags",
    "created_at",
    "compute_s",
    "wall_s",
    "corpus",
    "finished_at",
)


def run_record(run: dict) -> dict:
    """A row of ``Store.list_runs`` with its fields in the CLI's order."""
    return {k: run[k] for k in RUN_FIELDS if k in run} | {k: v for k, v in run.items() if k not in RUN_FIELDS}


def records(columns: list[str], rows: list[tuple]) -> list[dict]:
    """One object per row, its values as JSON takes them."""
    return [{c: jsonable(v) for c, v in zip(columns, row)} for row in rows]


def with_scheme(columns: list[str], rows: list[tuple], schemes: list[str]) -> Rows:
    """Rows with intervals (``*_lo`` columns) but no ``interval_by`` gain it: the runs' replicate
    schemes (SPEC §5d), as ``headatlas query … --format json`` names them."""
    if "interval_by" in columns or not any(c.endswith("_lo") for c in columns):
        return columns, rows
    named = " / ".join(sorted(set(schemes)))
    return [*columns, "interval_by"], [(*r, named) for r in rows]


def json_bytes(document: Any) -> bytes:
    """The document as compact JSON: no indentation, which only the pure-Python encoder writes (a
    run's page is 0.8 MB of it); the same document as the CLI's ``--format json``."""
    return json.dumps(jsonable(document), separators=(",", ":"), default=str).encode("utf-8")


def csv_bytes(columns: list[str], rows: list[tuple]) -> bytes:
    """CSV with a header line; an empty cell for null."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if v is None else jsonable(v) for v in row])
    return out.getvalue().encode("utf-8")
