"""Per-head sums stored by name (table ``named_head_sums``, migration 0016): those of a measure or
metric installed beside headatlas, which has no column of ``head_stats``.

A batch result's head sum (``BatchResult.rep_heads[name]``, ``[group, layer, head]``) whose name
is not one of headatlas's own head sums (``metrics.HEAD_SUMS``), ``"<measure>.<sum>"`` by
convention, becomes one row per (replicate group, layer, head) and name here. Its rows are summed
like ``head_stats``' (per replicate group and key within a storing transaction, by compaction
after), so a sum is additive over batches in the same way. The views read the sums that installed
plugin metrics declare as columns of their own name (``pivoted_head_stats``), strict as
``head_stats``' are: a batch stored without a sum leaves the run's sum NULL, not partial.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.metrics import HEAD_SUMS, Sum, sql_name

TABLE = "named_head_sums"
KEYS = ("run_id", "batch_id", "rep", "layer", "head")


def named(rep_heads: dict[str, np.ndarray]) -> list[str]:
    """The head sums of a payload that are stored by name (not columns of ``head_stats``)."""
    return sorted(k for k in rep_heads if k not in HEAD_SUMS)


def named_rows(
    run_id: int,
    label: int,
    reps: np.ndarray,
    shape: tuple[int, int, int],
    results: Sequence,
    summed: Callable[[str], np.ndarray],
) -> pa.Table | None:
    """The rows of ``named_head_sums`` for ``results`` (one storing transaction's batch results):
    the sums that every result carries (one a batch lacks is left out of the group, so the run's
    sum reads NULL), each ``summed(name)`` (``[group, layer, head]`` over the group's replicate
    groups ``reps``) as one row per cell, under the group's batch id ``label``; None: none."""
    names = [n for n in named(results[0].rep_heads) if all(n in r.rep_heads for r in results)]
    if not names:
        return None
    rep, layer, head = (a.ravel() for a in np.indices(shape))
    cells = rep.size
    values = np.concatenate([np.asarray(summed(n), dtype=np.float64).ravel() for n in names])
    return pa.table(
        {
            "run_id": np.full(cells * len(names), run_id, dtype=np.int64),
            "batch_id": np.full(cells * len(names), label, dtype=np.int64),
            "rep": np.tile(reps[rep], len(names)),
            "layer": np.tile(layer, len(names)),
            "head": np.tile(head, len(names)),
            "name": pa.DictionaryArray.from_arrays(
                pa.array(np.repeat(np.arange(len(names), dtype=np.int32), cells)), pa.array(names, type=pa.string())
            ),
            "value": values,
        }
    )


def pivoted_head_stats(sums: Sequence[Sum]) -> str:
    """SQL: ``head_stats`` with a column per sum of ``sums`` (the installed plugins'), read from
    ``named_head_sums`` row by row (the same run, batch, group, layer and head): NULL where the
    batch stored none, as a ``head_stats`` column added later reads for rows stored before it."""
    if not sums:
        return "head_stats"

    def one(s: Sum) -> str:
        value = f"sum(value) FILTER (WHERE name = '{s.name}')"
        return f"{f'CAST({value} AS BIGINT)' if s.kind is int else value} AS {sql_name(s.name)}"

    keys = ", ".join(KEYS)
    pivot = f"SELECT {keys}, {', '.join(one(s) for s in sums)} FROM {TABLE} GROUP BY {keys}"
    picked = ", ".join(f"n.{sql_name(s.name)}" for s in sums)
    return f"(SELECT s.*, {picked} FROM head_stats s LEFT JOIN ({pivot}) n USING ({keys})) AS head_rows"


def read(conn: Connection, run_id: int, *, names: Sequence[str] = ()) -> tuple[list[str], list[tuple]]:
    """A run's sums stored by name, per head: ``layer, head, name, value`` summed over its batches
    and replicate groups, ordered by name, layer and head (``names``: only these)."""
    result = conn.execute(
        text(
            f"SELECT layer, head, name, sum(value) AS value FROM {TABLE} WHERE run_id = :run "
            "AND (len(CAST(:names AS VARCHAR[])) = 0 OR list_contains(CAST(:names AS VARCHAR[]), name)) "
            "GROUP BY layer, head, name ORDER BY name, layer, head"
        ),
        {"run": run_id, "names": list(names)},
    )
    return list(result.keys()), [tuple(r) for r in result.fetchall()]
