"""Per-layer questions of a run (SPEC §5): the layer table, from early to final layers, and the
sentence boundaries. Returns (columns, rows).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.metrics import COLUMNS
from headatlas.service.reports.query_support import (
    FIRST_TOKEN_COLUMNS,
    Rows,
    fetch_rows,
    for_attention,
    with_intervals,
    without_intervals,
)

LAYER_COLUMNS = ("layer", *(c.name for c in COLUMNS if c.layers))


def layers(conn: Connection, run_id: int, *, ci: bool = False) -> Rows:
    """Per-layer summary: the progression from early to final layers, and anchor distinctness
    (SPEC §5): ``anchor_distinct_share`` = distinct anchors among the layer's anchored heads per
    window, over those heads, pooled over windows (1: every head its own anchor; 1/H: one anchor
    for all H heads)."""
    from headatlas.service.storage import run_results as stored

    kept = stored.load(conn, run_id, "layers")  # stored with intervals (``query layers --ci``)
    if kept is not None:
        return kept if ci else without_intervals(kept)
    cols = ", ".join(f"l.{c}" for c in LAYER_COLUMNS)
    # the view's distinct_share (windows in which *all* the layer's anchors differ) stays for SQL:
    # with 12 heads that event almost never happens, so it measures the head count, not the heads
    sql = f"""
        SELECT {cols}, d.distinct_anchor_ratio AS anchor_distinct_share
        FROM layer_metrics l LEFT JOIN anchor_distinctness d USING (run_id, layer)
        WHERE l.run_id = :run ORDER BY l.layer
    """
    from headatlas.service.reports.query_support import one_read

    # with intervals: the values and their intervals from one read of layer_metrics_reps (one_read
    # opens the shared reads _layers_from_reps takes them from)
    with one_read(ci):
        rows = _layers_from_reps(conn, run_id) if ci else fetch_rows(conn, sql, {"run": run_id})
        if ci:
            columns, values = rows
            rows = with_intervals(
                conn,
                (columns[: len(LAYER_COLUMNS)], [r[: len(LAYER_COLUMNS)] for r in values]),
                view="layer_metrics_reps",
                keys=("layer",),
                run_id=run_id,
            )
            rows = (
                rows[0] + columns[len(LAYER_COLUMNS) :],
                [a + b[len(LAYER_COLUMNS) :] for a, b in zip(rows[1], values)],
            )
        return for_attention(conn, run_id, rows)


def _layers_from_reps(conn: Connection, run_id: int) -> Rows:
    """``layers``' rows within ``shared_reads`` (a finished run's derivation): ``layer_metrics`` is
    ``layer_metrics_reps`` at ``drop_rep = -1``, whose rows the intervals read anyway
    (``replicate_view``), so the values come from them (one plan of the view chain fewer) and
    only the anchors' distinctness is read here."""
    from headatlas.service.reports.query_support import replicate_view

    names, every = replicate_view(conn, "layer_metrics_reps", ("layer",), run_id)
    drop, li = names.index("drop_rep"), names.index("layer")
    picked = [names.index(c) for c in LAYER_COLUMNS]
    found = conn.execute(
        text("SELECT layer, distinct_anchor_ratio FROM anchor_distinctness WHERE run_id = :run"), {"run": run_id}
    )
    ratio: dict[int, float | None] = {r[0]: r[1] for r in found}
    return [*LAYER_COLUMNS, "anchor_distinct_share"], [
        (*(r[i] for i in picked), ratio.get(r[li])) for r in every if r[drop] == -1
    ]


def boundaries(conn: Connection, run_id: int, *, ci: bool = False) -> Rows:
    """Per layer: do high-similarity pairs stay within sentences beyond what their distances
    explain, and does attention go to sentence separators beyond uniform?"""
    sql = """
        WITH per_head AS (
            SELECT layer, count(*) FILTER (WHERE within_sentence_lift > 1) AS heads_above_chance,
                   count(within_sentence_lift_dm) FILTER (WHERE within_sentence_lift_dm > 1) AS heads_above_chance_dm,
                   max(within_sentence) AS max_head_within_sentence,
                   -- the lowest of tied heads: arg_max picks any of them, and not always the same
                   -- (within_sentence is a ratio of counts, so small runs have exact ties)
                   arg_max(head, [within_sentence, -head]) FILTER (WHERE within_sentence IS NOT NULL) AS top_head
            FROM head_metrics WHERE run_id = :run GROUP BY layer
        )
        SELECT l.layer, l.within_sentence, l.within_sentence_chance, l.within_sentence_lift,
               l.within_sentence_chance_dm, l.within_sentence_lift_dm,
               p.heads_above_chance, p.heads_above_chance_dm, p.max_head_within_sentence, p.top_head,
               l.attn_to_punct, l.attn_to_punct_lift, l.attn_to_sep, l.attn_to_sep_lift,
               l.attn_to_cls, l.attn_to_cls_lift, l.attn_to_first, l.attn_to_first_lift
        FROM layer_metrics l JOIN per_head p USING (layer)
        WHERE l.run_id = :run ORDER BY l.layer
    """
    rows = fetch_rows(conn, sql, {"run": run_id})
    if ci:
        rows = with_intervals(conn, rows, view="layer_metrics_reps", keys=("layer",), run_id=run_id)
    # an encoder's first token is its [CLS]: attn_to_first would repeat attn_to_cls here
    return for_attention(conn, run_id, rows, encoder_hides=FIRST_TOKEN_COLUMNS)
