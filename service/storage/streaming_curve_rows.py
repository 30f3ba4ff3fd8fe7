"""Rows of ``streaming_curves`` and ``streaming_curve_steps`` (migration 0020, SPEC §10): a run's
memory curves, KV heads streamed cumulatively in orders. Written inside the caller's transaction,
on either backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.engine import Connection

CURVE_FIELDS = (
    "curve_id",
    "created_at",
    "sink",
    "recent",
    "objective",
    "unit",
    "orders",
    "step",
    "seeds",
    "layers",
    "kv_heads",
    "d_head",
    "seq_len",
    "kv_bytes",
    "full_cache",
    "selection",
    "selection_windows",
    "evaluation_windows",
    "evaluated",
    "scheme",
    "groups",
    "intact",
    "seconds",
)
STEP_COLUMNS = (
    "order",
    "step",
    "kv_heads_streaming",
    "fraction",
    "memory_saved",
    "memory_share",
    "objective",
    "objective_lo",
    "objective_hi",
    "increase",
    "increase_lo",
    "increase_hi",
)


@dataclass
class StoredMemoryCurve:
    """A stored memory curve: how it was made (``meta``, CURVE_FIELDS) and its rows (STEP_COLUMNS),
    with the KV heads that start streaming at each row's step in ``streamed`` (``layer.kv_head``)."""

    run_id: int
    meta: dict
    columns: list[str] = field(default_factory=lambda: list(STEP_COLUMNS))
    rows: list[tuple] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)

    def orders(self) -> list[str]:
        return list(dict.fromkeys(r[0] for r in self.rows))

    def steps_of(self, order: str) -> list[tuple[tuple, list[tuple[int, int]]]]:
        """The rows of ``order`` in step order, each with the KV heads added at its step."""
        out = []
        for row, heads in zip(self.rows, self.streamed, strict=True):
            if row[0] == order:
                out.append((row, [_head(h) for h in heads.split()]))
        return sorted(out, key=lambda pair: pair[0][1])


def _head(said: str) -> tuple[int, int]:
    layer, kv = said.split(".")
    return int(layer), int(kv)


def _number(value):
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def store_memory_curve(conn: Connection, run_id: int, meta: dict, rows: list[tuple], streamed: list[str]) -> int:
    """Store one memory curve of run ``run_id`` (``meta``: CURVE_FIELDS less ``curve_id`` and
    ``created_at``; ``rows``: STEP_COLUMNS; ``streamed``: per row, the KV heads added at its step).
    Returns its ``curve_id``."""
    curve_id = int(
        conn.execute(
            text("SELECT coalesce(max(curve_id), 0) + 1 FROM streaming_curves WHERE run_id = :r"), {"r": run_id}
        ).scalar()
        or 1
    )
    values = {k: meta[k] for k in CURVE_FIELDS if k not in ("curve_id", "created_at")}
    conn.execute(
        text(
            f"INSERT INTO streaming_curves (run_id, curve_id, created_at, {', '.join(values)}) "
            f"VALUES (:r, :c, now(), {', '.join(':' + k for k in values)})"
        ),
        {"r": run_id, "c": curve_id, **values},
    )
    names = STEP_COLUMNS[1:]
    if rows:
        conn.execute(
            text(
                f"INSERT INTO streaming_curve_steps (run_id, curve_id, order_name, {', '.join(names)}, streamed) "
                f"VALUES (:r, :c, :order, {', '.join(':' + c for c in names)}, :streamed)"
            ),
            [
                {"r": run_id, "c": curve_id, **{k: _number(v) for k, v in zip(STEP_COLUMNS, row)}, "streamed": heads}
                for row, heads in zip(rows, streamed, strict=True)
            ],
        )
    return curve_id


def load_memory_curve(conn: Connection, run_id: int, curve_id: int | None = None) -> StoredMemoryCurve | None:
    """A stored memory curve of the run (the newest when ``curve_id`` is None), or None."""
    found = conn.execute(
        text(
            f"SELECT {', '.join(CURVE_FIELDS)} FROM streaming_curves WHERE run_id = :r "
            + ("AND curve_id = :c " if curve_id is not None else "")
            + "ORDER BY curve_id DESC LIMIT 1"
        ),
        {"r": run_id, "c": curve_id},
    ).first()
    if found is None:
        return None
    meta = dict(zip(CURVE_FIELDS, found))
    rows = conn.execute(
        text(
            f"SELECT order_name, {', '.join(STEP_COLUMNS[1:])}, streamed FROM streaming_curve_steps "
            "WHERE run_id = :r AND curve_id = :c "
            "ORDER BY CASE WHEN order_name LIKE 'random:%' THEN 1 ELSE 0 END, order_name, step"
        ),
        {"r": run_id, "c": meta["curve_id"]},
    ).all()
    return StoredMemoryCurve(run_id, meta, rows=[tuple(r[:-1]) for r in rows], streamed=[r[-1] for r in rows])
