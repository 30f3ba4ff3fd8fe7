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


# --- mixing measures (SPEC §6) -------------------------------------------------------------------
MIXING_MEASURES = {
    # name shown: SQL over mixing_metrics
    "self": "to_self",
    "neighbours": "to_prev + to_next",
    "specials": "to_cls + to_sep",
    "punctuation": "to_punct",
    "mean_distance": "mean_distance",
}
METHOD_ORDER = ("attention", "attribution", "rollout", "norm", "alti")


def _mixing_methods(conn: Connection, run_id: int, methods: list[str] | None) -> list[str]:
    stored = [r[0] for r in conn.execute(
        text("SELECT DISTINCT method FROM mixing_metrics WHERE run_id = :run"), {"run": run_id})]
    if not stored:
        raise ParameterError(
            f"run {run_id} has no mixing measures: analyse with --attribution and/or --mixing rollout,norm,alti"
        )
    if not methods:
        return [m for m in METHOD_ORDER if m in stored]
    for m in methods:
        if m not in METHOD_ORDER:
            raise ParameterError(f"--method {m!r}: choose one of {', '.join(METHOD_ORDER)}")
        if m not in stored:
            raise ParameterError(
                f"--method {m}: run {run_id} has only {', '.join(x for x in METHOD_ORDER if x in stored)}; "
                f"analyse with {'--attribution' if m == 'attribution' else '--mixing ' + m} to add it"
            )
    return list(dict.fromkeys(methods))


def mixing(conn: Connection, run_id: int, *, layer: int | None = None, methods: list[str] | None = None) -> Rows:
    """Where each output's mixture comes from: mass to self / neighbours / specials / punctuation
    and the mean distance, one column per method. Per layer (the layer-level rows), or per head
    of ``layer`` (head -1 = the layer-level row)."""
    chosen = _mixing_methods(conn, run_id, methods)
    measures = ", ".join(f"{sql} AS {name}" for name, sql in MIXING_MEASURES.items())
    where = "head = -1" if layer is None else "layer = :layer"
    result = conn.execute(text(
        f"SELECT layer, head, method, {measures} FROM mixing_metrics "
        f"WHERE run_id = :run AND {where} ORDER BY layer, head"
    ), {"run": run_id, "layer": layer})
    values: dict[tuple, dict] = {}
    for row in result.mappings():
        if row["method"] in chosen:
            values.setdefault((row["layer"], row["head"]), {})[row["method"]] = row
    keys = sorted(values, key=lambda k: (k[0], k[1] if k[1] >= 0 else 10_000))  # layer row after its heads
    columns = (["layer"] if layer is None else ["layer", "head"]) + ["measure"] + chosen
    rows = []
    for key in keys:
        for measure in MIXING_MEASURES:
            by_method = values[key]
            cells = [by_method[m][measure] if m in by_method else None for m in chosen]
            lead = (key[0],) if layer is None else (key[0], "layer" if key[1] < 0 else key[1])
            rows.append((*lead, measure, *cells))
    return columns, rows


def discrepancy(conn: Connection, run_id: int, *, method: str = "attribution", top: int | None = None) -> Rows:
    """Per head: how far ``method``'s rows are from the head's attention rows (mean JSD, bits),
    ranked, with the layer's mean and what each says about self and distance."""
    _mixing_methods(conn, run_id, [method])
    sql = """
        WITH m AS (SELECT * FROM mixing_metrics WHERE run_id = :run AND head >= 0)
        SELECT row_number() OVER (ORDER BY x.jsd_attention DESC, x.layer, x.head) AS rank,
               x.layer, x.head, x.jsd_attention AS jsd,
               avg(x.jsd_attention) OVER (PARTITION BY x.layer) AS layer_mean_jsd,
               a.to_self AS attention_self, x.to_self AS method_self,
               a.mean_distance AS attention_distance, x.mean_distance AS method_distance,
               a.entropy AS attention_entropy, x.entropy AS method_entropy
        FROM m x JOIN m a ON a.method = 'attention' AND a.layer = x.layer AND a.head = x.head
        WHERE x.method = :method
        ORDER BY rank LIMIT :limit
    """
    return _rows(conn, sql, {"run": run_id, "method": method, "limit": top or 1_000_000})


def discrepancy_layers(conn: Connection, run_id: int, *, method: str = "attribution") -> Rows:
    """Per layer: mean and spread of the per-head JSD, and the layer-level rows' JSD and self share."""
    _mixing_methods(conn, run_id, [method])
    sql = """
        SELECT layer,
               avg(jsd_attention) FILTER (WHERE head >= 0) AS mean_head_jsd,
               min(jsd_attention) FILTER (WHERE head >= 0) AS min_head_jsd,
               max(jsd_attention) FILTER (WHERE head >= 0) AS max_head_jsd,
               any_value(jsd_attention) FILTER (WHERE head = -1) AS layer_jsd,
               any_value(to_self) FILTER (WHERE head = -1) AS layer_self,
               any_value(mean_distance) FILTER (WHERE head = -1) AS layer_mean_distance
        FROM mixing_metrics WHERE run_id = :run AND method = :method
        GROUP BY layer ORDER BY layer
    """
    return _rows(conn, sql, {"run": run_id, "method": method})


LAYER_METRICS = (
    "within_sentence", "within_sentence_chance", "within_sentence_lift", "repetition", "repetition_chance",
    "mean_distance", "mean_distance_chance", "short_range_share", "noise_share", "attn_to_cls", "attn_to_sep",
    "attn_to_punct", "attn_to_self", "attn_entropy",
)


def trend(conn: Connection, schedule_id: int, *, metric: str, layer: int | None = None,
          head: int | None = None) -> Rows:
    """A metric across a schedule's runs, in fire order: one head (``layer`` and ``head``, from
    head_metrics), one layer (``layer``, from layer_metrics) or the mean over layers. A run
    shared by several fires (nothing changed between them) appears once, at its first fire."""
    if head is not None and layer is None:
        raise ParameterError("--head needs --layer: a head is named by its layer and its index")
    allowed = SORTABLE if head is not None else LAYER_METRICS
    if metric not in allowed:
        raise ParameterError(f"--metric {metric!r}: choose one of {', '.join(allowed)}")
    if head is not None:
        value = f"SELECT run_id, {metric} AS value FROM head_metrics WHERE layer = :layer AND head = :head"
    elif layer is not None:
        value = f"SELECT run_id, {metric} AS value FROM layer_metrics WHERE layer = :layer"
    else:
        value = f"SELECT run_id, avg({metric}) AS value FROM layer_metrics GROUP BY run_id"
    sql = f"""
        WITH fired AS (
            SELECT run_key, min(fire_time) AS fire_time FROM schedule_fires
            WHERE schedule_id = :s AND run_key IS NOT NULL GROUP BY run_key
        ),
        mine AS (SELECT r.run_id, r.name, r.status, f.fire_time FROM fired f JOIN runs r USING (run_key)),
        v AS (SELECT * FROM ({value}) WHERE run_id IN (SELECT run_id FROM mine))
        SELECT mine.fire_time, mine.run_id, mine.name AS run, mine.status, v.value AS {metric}
        FROM mine LEFT JOIN v USING (run_id)
        ORDER BY mine.fire_time
    """
    return _rows(conn, sql, {"s": schedule_id, "layer": layer, "head": head})
