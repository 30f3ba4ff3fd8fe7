"""Rows of ``streaming_effects`` (migration 0019, SPEC §10): each KV head's streaming effect per
replicate group, for one restriction (S sinks, W recent keys) of a run. Written inside the
caller's transaction, on either backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sqlalchemy import text
from sqlalchemy.engine import Connection

SUMS = ("windows", "tokens", "effect_sum", "beyond_sum", "objective_sum")


@dataclass
class StreamingSums:
    """One restriction's sums: ``reps`` the replicate groups ``[group]``; ``sums[name]`` ``[group,
    layer, kv_head]`` (``SUMS``); ``longest`` the longest window's tokens; ``objective`` its name."""

    sink: int
    recent: int
    objective: str
    longest: int
    reps: np.ndarray
    sums: dict[str, np.ndarray]


def store_streaming(conn: Connection, run_id: int, sums: StreamingSums) -> int:
    """Replace run ``run_id``'s rows of this restriction by ``sums`` (groups without a window are
    left out); returns the rows written."""
    key = {"r": run_id, "s": sums.sink, "w": sums.recent}
    conn.execute(text("DELETE FROM streaming_effects WHERE run_id = :r AND sink = :s AND recent = :w"), key)
    rows = []
    _groups, n_layers, n_kv = sums.sums["windows"].shape
    for g, rep in enumerate(sums.reps.tolist()):
        for layer in range(n_layers):
            for kv in range(n_kv):
                if sums.sums["windows"][g, layer, kv] == 0:
                    continue
                values = {name: sums.sums[name][g, layer, kv].item() for name in SUMS}
                rows.append(
                    {**key, "rep": int(rep), "layer": layer, "kv": kv, "o": sums.objective, "n": sums.longest, **values}
                )
    if rows:
        conn.execute(
            text(
                "INSERT INTO streaming_effects (run_id, sink, recent, rep, layer, kv_head, objective, longest, "
                f"{', '.join(SUMS)}) VALUES (:r, :s, :w, :rep, :layer, :kv, :o, :n, {', '.join(':' + s for s in SUMS)})"
            ),
            rows,
        )
    return len(rows)


# the restriction of each run the head tables show (``metrics.STREAMING_RULE``): the fewest recent
# keys W, then the fewest sinks S; with its KV heads' count, which maps a query head to its KV head
# (the views ``streaming_kv_reps`` and ``streaming_metrics`` join it; ``shown_restriction`` reads it)
SHOWN_RESTRICTION = """
    SELECT run_id, sink, recent, max(kv_head) + 1 AS kv_heads
    FROM streaming_effects GROUP BY run_id, sink, recent
    QUALIFY row_number() OVER (PARTITION BY run_id ORDER BY recent, sink) = 1
"""


def restrictions(conn: Connection, run_id: int) -> list[tuple[int, int]]:
    """The (sink, recent) restrictions the run holds streaming effects of."""
    return [
        (int(s), int(w))
        for s, w in conn.execute(
            text("SELECT DISTINCT sink, recent FROM streaming_effects WHERE run_id = :r ORDER BY sink, recent"),
            {"r": run_id},
        )
    ]


def shown_restriction(conn: Connection, run_id: int) -> tuple[int, int] | None:
    """The (sink, recent) restriction the head tables show of the run (``metrics.STREAMING_RULE``,
    as the views choose it), or None where it holds none."""
    # the views' rule over the table, not the view ``streaming_metrics``: that holds a row of every
    # restriction the table holds, and planning it cost about 20 ms a call in the suite
    # (benchmarks/suite_operations.py)
    row = conn.execute(
        text(f"SELECT sink, recent FROM ({SHOWN_RESTRICTION}) shown WHERE run_id = :r"), {"r": run_id}
    ).first()
    return None if row is None else (int(row[0]), int(row[1]))


def streaming_groups(conn: Connection, run_id: int) -> frozenset[int]:
    """The replicate groups (SPEC §5d) that hold the streaming windows of the restriction shown:
    the groups its jackknife drops one at a time (``effect_rows.effect_groups`` says why)."""
    shown = shown_restriction(conn, run_id)
    if shown is None:
        return frozenset()
    rows = conn.execute(
        text("SELECT DISTINCT rep FROM streaming_effects WHERE run_id = :r AND sink = :s AND recent = :w"),
        {"r": run_id, "s": shown[0], "w": shown[1]},
    ).all()
    return frozenset(int(r[0]) for r in rows)


def streaming_note(conn: Connection, run_id: int) -> str | None:
    """The line under a head table with streaming effects: the restriction shown, on how many
    windows, and the rule that chose it where the run holds several; None where it holds none."""
    from headatlas.service.metrics import STREAMING_RULE
    from headatlas.service.wording import counted

    held = restrictions(conn, run_id)
    shown = shown_restriction(conn, run_id)
    if shown is None:
        return None
    windows, objective = conn.execute(
        text(
            "SELECT max(windows), any_value(objective) FROM streaming_metrics "
            "WHERE run_id = :r AND sink = :s AND recent = :w"
        ),
        {"r": run_id, "s": shown[0], "w": shown[1]},
    ).one()
    others = ", ".join(f"S = {s}, W = {w}" for s, w in held if (s, w) != shown)
    return (
        f"effect_streaming = O(the head's KV head streaming) − O(intact), O = {objective}, with S = {shown[0]} sinks "
        f"and W = {shown[1]} recent keys, over {counted(int(windows or 0), 'window')}; streaming_beyond: the attention "
        "mass beyond them; a query head shows its KV head's (grouped-query attention)"
        + (f"; also stored: {others}: {STREAMING_RULE}" if others else "")
    )


def streaming_sums(conn: Connection, run_id: int, sink: int, recent: int) -> StreamingSums | None:
    """The run's sums of one restriction, or None where it holds none."""
    rows = conn.execute(
        text(
            f"SELECT rep, layer, kv_head, objective, longest, {', '.join(SUMS)} FROM streaming_effects "
            "WHERE run_id = :r AND sink = :s AND recent = :w ORDER BY rep, layer, kv_head"
        ),
        {"r": run_id, "s": sink, "w": recent},
    ).fetchall()
    if not rows:
        return None
    reps = sorted({int(r[0]) for r in rows})
    n_layers = 1 + max(int(r[1]) for r in rows)
    n_kv = 1 + max(int(r[2]) for r in rows)
    index = {rep: g for g, rep in enumerate(reps)}
    sums = {name: np.zeros((len(reps), n_layers, n_kv)) for name in SUMS}
    for row in rows:
        g, layer, kv = index[int(row[0])], int(row[1]), int(row[2])
        for k, name in enumerate(SUMS):
            sums[name][g, layer, kv] = row[5 + k]
    return StreamingSums(
        sink=sink,
        recent=recent,
        objective=str(rows[0][3]),
        longest=max(int(r[4]) for r in rows),
        reps=np.array(reps, dtype=np.int64),
        sums=sums,
    )


def long_range_share(conn: Connection, run_id: int, recent: int, n_kv: int) -> np.ndarray | None:
    """Each of ``n_kv`` KV heads' long-range share of high-similarity pairs, ``[layer, kv_head]``:
    the pairs of its query heads (query head h of H reads KV head ``h // (H / n_kv)``) at a
    distance ≥ ``recent`` over all of theirs, from the run's distance histograms
    (``distance_totals``); NaN for a KV head without a pair, None where the run holds none."""
    heads = conn.execute(text("SELECT max(head) + 1 FROM head_stats WHERE run_id = :r"), {"r": run_id}).scalar()
    if not heads:
        return None
    rows = conn.execute(
        text(
            "SELECT layer, head // :g AS kv, sum(high_pairs) FILTER (WHERE distance >= :w), sum(high_pairs) "
            "FROM distance_totals WHERE run_id = :r GROUP BY layer, kv ORDER BY layer, kv"
        ),
        {"r": run_id, "g": max(1, int(heads) // n_kv), "w": recent},
    ).fetchall()
    if not rows:
        return None
    out = np.full((1 + max(int(r[0]) for r in rows), 1 + max(int(r[1]) for r in rows)), np.nan)
    for layer, kv, far, total in rows:
        if total:
            out[int(layer), int(kv)] = float(far or 0) / float(total)
    return out
