"""The heads' top examples in the store (migration 0021): the rows a storing transaction adds, and
their compaction when the run finishes.

A batch result carries its reservoir (service/measures/examples.py) in
``BatchResult.measures["examples"]``; the batches stored in one transaction are merged into one
reservoir here (the top k of their tops, as the run's additive sums are summed per transaction in
batch_rows.py), whose examples become ``head_examples`` rows and whose windows' tokens become
``example_windows`` rows. Compaction keeps the best ``keep`` of each (layer, head, kind) and the
windows they are of: a finished run holds heads × kinds × k examples, whatever its corpus.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.engine.results import BatchResult

TABLES = ("head_examples", "example_windows")
MEASURE = "examples"  # the measure's name: its arrays in BatchResult.measures
ORDER = "score DESC, window_id, pos_i, pos_j"  # the reservoir's order (examples.Reservoir)


def example_tables(run_id: int, items: list[tuple[int, BatchResult]]) -> dict[str, pa.Table]:
    """The ``head_examples`` and ``example_windows`` rows of ``items`` ([(batch_id, BatchResult)],
    one run's, stored in one transaction), under the group's first batch id; none where no batch
    kept examples (a run with ``examples = 0``, or batches of an earlier version)."""
    from headatlas.service.measures.examples import Reservoir, array_texts

    held = [(b, res) for b, res in items if MEASURE in res.measures]
    if not held:
        return {}
    label = min(b for b, _ in items)
    merged = None
    tokens: dict[str, list[str]] = {}
    for _, res in held:
        arrays = res.measures[MEASURE]
        part = Reservoir.of_payload(arrays, res.window_ids)
        merged = part if merged is None else merged.merge(part)
        vocab = dict(zip(np.asarray(arrays["vocab_ids"]).tolist(), array_texts(arrays["vocab_text"])))
        for w, ids in zip(np.asarray(arrays["token_windows"]).tolist(), np.asarray(arrays["tokens"])):
            tokens[res.window_ids[w]] = [vocab.get(t, str(t)) for t in ids.tolist() if t >= 0]
    assert merged is not None
    rows = list(merged.examples())

    def token(window_id: str, pos: int) -> str | None:
        found = tokens.get(window_id, [])
        return found[pos] if 0 <= pos < len(found) else None

    kept = merged.window_ids()
    return {
        "head_examples": pa.table(
            {
                "run_id": pa.array([run_id] * len(rows), type=pa.int32()),
                "batch_id": pa.array([label] * len(rows), type=pa.int32()),
                "layer": pa.array([r.layer for r in rows], type=pa.int16()),
                "head": pa.array([r.head for r in rows], type=pa.int16()),
                "kind": pa.array([r.kind for r in rows], type=pa.string()),
                "keep": pa.array([merged.k] * len(rows), type=pa.int32()),
                "score": pa.array([r.score for r in rows], type=pa.float64()),
                "value": pa.array([r.value for r in rows], type=pa.float64()),
                "window_id": pa.array([r.window_id for r in rows], type=pa.string()),
                "pos_i": pa.array([r.pos_i for r in rows], type=pa.int32()),
                "pos_j": pa.array([r.pos_j if r.pos_j >= 0 else None for r in rows], type=pa.int32()),
                "token_i": pa.array([token(r.window_id, r.pos_i) or "" for r in rows], type=pa.string()),
                "token_j": pa.array(
                    [token(r.window_id, r.pos_j) if r.pos_j >= 0 else None for r in rows], type=pa.string()
                ),
            }
        ),
        "example_windows": pa.table(
            {
                "run_id": pa.array([run_id] * len(kept), type=pa.int32()),
                "batch_id": pa.array([label] * len(kept), type=pa.int32()),
                "window_id": pa.array(kept, type=pa.string()),
                "tokens": pa.array([json.dumps(tokens.get(w, []), ensure_ascii=False) for w in kept], type=pa.string()),
            }
        ),
    }


def compact(conn: Connection, run_id: int) -> dict[str, tuple[int, int]]:
    """Keep the run's best ``keep`` examples of each (layer, head, kind) and the windows they are
    of, under batch id -1 (compact.COMPACTED), inside the caller's transaction. Returns {table:
    (rows before, after)}."""
    report = {}
    before = _count(conn, "head_examples", run_id)
    if before:
        conn.execute(
            text(
                "CREATE TEMP TABLE _examples AS SELECT * REPLACE (-1 AS batch_id) FROM head_examples "
                f"WHERE run_id = :r QUALIFY row_number() OVER (PARTITION BY layer, head, kind ORDER BY {ORDER}) <= keep"
            ),
            {"r": run_id},
        )
        conn.execute(text("DELETE FROM head_examples WHERE run_id = :r"), {"r": run_id})
        conn.execute(text("INSERT INTO head_examples BY NAME SELECT * FROM _examples"))
        conn.execute(text("DROP TABLE _examples"))
    report["head_examples"] = (before, _count(conn, "head_examples", run_id))
    windows = _count(conn, "example_windows", run_id)
    if windows:
        conn.execute(
            text(
                "CREATE TEMP TABLE _example_windows AS SELECT run_id, -1 AS batch_id, window_id, any_value(tokens) AS tokens "
                "FROM example_windows WHERE run_id = :r AND window_id IN "
                "(SELECT window_id FROM head_examples WHERE run_id = :r) GROUP BY run_id, window_id"
            ),
            {"r": run_id},
        )
        conn.execute(text("DELETE FROM example_windows WHERE run_id = :r"), {"r": run_id})
        conn.execute(text("INSERT INTO example_windows BY NAME SELECT * FROM _example_windows"))
        conn.execute(text("DROP TABLE _example_windows"))
    report["example_windows"] = (windows, _count(conn, "example_windows", run_id))
    return report


def _count(conn: Connection, table: str, run_id: int) -> int:
    return int(conn.execute(text(f"SELECT count(*) FROM {table} WHERE run_id = :r"), {"r": run_id}).scalar_one())
