"""A run's synthetic probe scores (SPEC §8, table ``probe_scores``): one probe per run, in the
caller's transaction."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.storage import db


def probe_spec(conn: Connection, run_id: int) -> tuple[int, int, int] | None:
    """The stored probe's (length, sequences, seed), or None when the run has none."""
    row = conn.execute(
        text("SELECT length, sequences, seed FROM probe_scores WHERE run_id = :r LIMIT 1"), {"r": run_id}
    ).first()
    return None if row is None else (int(row[0]), int(row[1]), int(row[2]))


def store_probe(conn: Connection, run_id: int, spec: tuple[int, int, int], scores: dict[str, np.ndarray]) -> bool:
    """Store the run's probe scores (``scores``: name -> ``[layer, head]``). The same probe stored
    again is skipped (returns False), another one (other length, sequences or seed) replaces it."""
    if probe_spec(conn, run_id) == tuple(spec):
        return False
    conn.execute(text("DELETE FROM probe_scores WHERE run_id = :r"), {"r": run_id})
    values = {name: np.asarray(v, dtype=np.float64) for name, v in scores.items()}
    n_layers, n_heads = values["induction_score"].shape
    layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    length, sequences, seed = spec
    table = pa.table(
        {
            "run_id": np.full(layer.size, run_id, dtype=np.int32),
            "layer": layer.ravel().astype(np.int16),
            "head": head.ravel().astype(np.int16),
            "length": np.full(layer.size, length, dtype=np.int32),
            "sequences": np.full(layer.size, sequences, dtype=np.int32),
            "seed": np.full(layer.size, seed, dtype=np.int64),
            **{name: v.ravel() for name, v in values.items()},
        }
    )
    raw = db.driver_connection(conn)
    raw.register("_in_probe_scores", table)
    try:
        conn.exec_driver_sql("INSERT INTO probe_scores BY NAME SELECT * FROM _in_probe_scores")
    finally:
        raw.unregister("_in_probe_scores")
    return True
