"""Questions users ask of a run, as SQL over the views (SPEC §5). Returns (columns, rows).

Column names are SPEC names; layers and heads are 0-based (the papers count from 1).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from service.errors import ParameterError

HEAD_COLUMNS = (
    "layer", "head", "within_sentence", "within_sentence_chance", "within_sentence_lift",
    "repetition", "repetition_chance", "repetition_lift", "mean_distance", "mean_distance_chance",
    "short_range_share", "noise_share", "attn_to_cls", "attn_to_sep", "attn_to_punct",
    "attn_to_self", "attn_to_prev", "attn_to_next", "attn_entropy", "high_pairs", "windows",
)
SORTABLE = HEAD_COLUMNS[2:]

Rows = tuple[list[str], list[tuple]]


def _rows(conn: Connection, sql: str, params: dict) -> Rows:
    result = conn.execute(text(sql), params)
    return list(result.keys()), [tuple(r) for r in result]


def heads(conn: Connection, run_id: int, *, layer: int | None = None, sort: str | None = None,
          top: int | None = None, anchors: int = 3) -> Rows:
    if sort is not None and sort not in SORTABLE:
        raise ParameterError(f"--sort {sort!r}: choose one of {', '.join(SORTABLE)}")
    order = f"{sort} DESC NULLS LAST, layer, head" if sort else "layer, head"
    cols = ", ".join(f"m.{c}" for c in HEAD_COLUMNS)
    sql = f"""
        WITH ranked AS (
            SELECT layer, head, token, window_share,
                   row_number() OVER (PARTITION BY layer, head ORDER BY windows DESC, token) AS rank
            FROM anchor_counts WHERE run_id = :run
        ),
        top_anchors AS (
            SELECT layer, head,
                   string_agg(token || ' ' || printf('%.0f%%', 100 * window_share), ', ' ORDER BY rank) AS anchors
            FROM ranked WHERE rank <= :n_anchors GROUP BY layer, head
        )
        SELECT {cols}, a.anchors AS top_anchors
        FROM head_metrics m LEFT JOIN top_anchors a USING (layer, head)
        WHERE m.run_id = :run AND (CAST(:layer AS INTEGER) IS NULL OR m.layer = :layer)
        ORDER BY {order}
        LIMIT :limit
    """
    return _rows(conn, sql, {"run": run_id, "layer": layer, "limit": top or 1_000_000, "n_anchors": anchors})


def distances(conn: Connection, run_id: int, *, layer: int, head: int | None = None) -> Rows:
    """Distance distribution of H (one head, or the layer's heads pooled) against chance."""
    sql = """
        WITH chance AS (
            SELECT distance, pairs, pairs / sum(pairs) OVER () AS chance_share
            FROM pair_profile WHERE run_id = :run
        ),
        high AS (
            SELECT distance, sum(high_pairs) AS high_pairs
            FROM distance_totals
            WHERE run_id = :run AND layer = :layer AND (CAST(:head AS INTEGER) IS NULL OR head = :head)
            GROUP BY distance
        )
        SELECT c.distance, coalesce(h.high_pairs, 0) AS high_pairs,
               coalesce(h.high_pairs, 0) / nullif(sum(coalesce(h.high_pairs, 0)) OVER (), 0) AS share,
               c.chance_share,
               share / nullif(c.chance_share, 0) AS lift
        FROM chance c LEFT JOIN high h USING (distance)
        ORDER BY c.distance
    """
    return _rows(conn, sql, {"run": run_id, "layer": layer, "head": head})


def boundaries(conn: Connection, run_id: int) -> Rows:
    """Per layer: do high-similarity pairs stay within sentences, and does attention go to
    sentence separators?"""
    sql = """
        WITH per_head AS (
            SELECT layer, count(*) FILTER (WHERE within_sentence_lift > 1) AS heads_above_chance,
                   max(within_sentence) AS max_head_within_sentence,
                   arg_max(head, within_sentence) AS top_head
            FROM head_metrics WHERE run_id = :run GROUP BY layer
        )
        SELECT l.layer, l.within_sentence, l.within_sentence_chance, l.within_sentence_lift,
               p.heads_above_chance, p.max_head_within_sentence, p.top_head,
               l.attn_to_punct, l.attn_to_sep, l.attn_to_cls
        FROM layer_metrics l JOIN per_head p USING (layer)
        WHERE l.run_id = :run ORDER BY l.layer
    """
    return _rows(conn, sql, {"run": run_id})


def layers(conn: Connection, run_id: int) -> Rows:
    """Per-layer summary: the progression from early to final layers."""
    sql = """
        SELECT l.layer, l.mean_distance, l.mean_distance_chance, l.short_range_share,
               l.within_sentence, l.within_sentence_lift, l.repetition, l.noise_share,
               l.attn_to_cls, l.attn_to_sep, l.attn_to_punct, l.attn_to_self, l.attn_entropy,
               d.distinct_share AS anchor_distinct_share, d.distinct_anchor_ratio
        FROM layer_metrics l LEFT JOIN anchor_distinctness d USING (run_id, layer)
        WHERE l.run_id = :run ORDER BY l.layer
    """
    return _rows(conn, sql, {"run": run_id})


def run_summary(conn: Connection, run_id: int) -> dict:
    row = conn.execute(text(
        "SELECT r.run_id, r.name, r.status, r.model_name, r.n_layers, r.n_heads, r.params, "
        "coalesce(c.windows, 0) AS windows, r.compute_s, r.wall_s "
        "FROM runs r LEFT JOIN chance_totals c USING (run_id) WHERE r.run_id = :run"
    ), {"run": run_id}).mappings().first()
    return dict(row) if row else {}
