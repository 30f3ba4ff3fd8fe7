"""The metric views, derived from the metric declarations (``service.metrics``).

Tables change only by versioned migrations, which never change after they land; these views are
derived objects instead: dropped and created again from the declarations at the end of every
upgrade that reaches the head revision (``migrations/env.py``), which is also how a new
database gets them. A metric added to the declarations therefore needs only the migration that
adds its sums' columns; its view columns follow. ``headatlas db upgrade`` on a current database
rebuilds them too. The columns of installed plugins' metrics (``metrics.all_columns``) are
built in beside headatlas's own, and their sums (``metrics.plugin_sums``, stored by name in
``named_head_sums``) are columns of ``head_reps`` and ``head_totals`` beside ``head_stats``'
(``named_sums.pivoted_head_stats``): a plugin installed later shows in the views after the next
``headatlas db upgrade``, and one removed leaves its columns (they read only stored sums, its
own by their names) until the next upgrade.

The views (the names and shapes of migration 0006, which first wrote them by hand):

- ``chance_reps``, ``head_reps``: per run (and layer, head) and ``drop_rep``, the sums of the whole
  run (``drop_rep = -1``) and of the run without replicate group g (the jackknife's rows).
- ``head_metrics_reps``, ``layer_metrics_reps``: every declared column, per head / per layer (its
  heads summed, the run sums once per head).
- ``chance_totals``, ``head_totals``, ``head_metrics``, ``layer_metrics``: their ``drop_rep = -1`` rows.
- ``streaming_reps``: the streaming effects' sums (table ``streaming_effects``, SPEC §10) per run,
  restriction (``sink`` S, ``recent`` W), layer, KV head and ``drop_rep``; ``streaming_kv_reps``:
  those of the restriction the head tables show (``metrics.STREAMING_RULE``), which
  ``head_metrics_reps`` joins to each query head by its KV head (``head // (H / H_kv)``) as the
  inputs of ``metrics.STREAMING_INPUTS``; ``streaming_metrics``: every restriction's mean effect and
  attention mass beyond sinks + W per KV head, with the 95% interval of the other metrics (the
  delete-one-group jackknife with the t quantile over the groups holding its windows, SPEC §5d).

The distance views they join (``pair_reps``, ``distance_reps``, ``head_distance_reps``,
``chance_distance_reps``, …) and ``run_reps`` stay as their migrations made them.

- ``series_head_metrics_reps``, ``series_head_metrics``: ``head_metrics_reps`` / ``head_metrics``
  with the probe's scores, against the steps of each training series (migration 0022,
  ``series_rows.series_views``).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.metrics import (
    CHANCE_SUMS,
    DISTANCE_INPUTS,
    HEAD_SUMS,
    STREAMING_INPUTS,
    all_columns,
    plugin_sums,
    sql_name,
)
from headatlas.service.storage.named_sums import pivoted_head_stats
from headatlas.service.storage.series_rows import series_views
from headatlas.service.storage.streaming_rows import SHOWN_RESTRICTION
from headatlas.service.storage.streaming_rows import SUMS as STREAMING_SUMS

# created in this order, dropped in the reverse
DERIVED_VIEWS = (
    "chance_reps",
    "head_reps",
    "streaming_reps",
    "streaming_kv_reps",
    "streaming_metrics",
    "head_metrics_reps",
    "layer_metrics_reps",
    "chance_totals",
    "head_totals",
    "head_metrics",
    "layer_metrics",
    "series_head_metrics_reps",
    "series_head_metrics",
)
_DM = ("same_sentence_dm", "same_token_dm", "same_word_dm")


def strict_sum(expr: str) -> str:
    """The sum, or NULL when any row lacks a value: a partial sum must not pass for a whole one."""
    return f"CASE WHEN count({expr}) = count(*) THEN sum({expr}) END"


def replicated_view(name: str, table: str, keys: tuple[str, ...], sums: tuple[str, ...]) -> str:
    """``name``: per key and ``drop_rep``, the sums of the whole run (-1) and of the run without
    each replicate group g."""
    key_list = ", ".join(keys)
    grouped = ", ".join(f"{strict_sum(col)} AS {col}" for col in sums)
    totals = ", ".join(f"{strict_sum(col)} AS {col}" for col in sums)
    on = " AND ".join(f"g.{k} = t.{k}" for k in keys)
    loo = ", ".join(f"t.{col} - coalesce(g.{col}, 0) AS {col}" for col in sums)
    return f"""
    CREATE VIEW {name} AS
    WITH g AS (SELECT {key_list}, rep, {grouped} FROM {table} GROUP BY {key_list}, rep),
         t AS (SELECT {key_list}, {totals} FROM g GROUP BY {key_list})
    SELECT {key_list}, -1 AS drop_rep, {", ".join(sums)} FROM t
    UNION ALL
    SELECT {", ".join(f"t.{k}" for k in keys)}, r.rep AS drop_rep, {loo}
    FROM t JOIN run_reps r ON r.run_id = t.run_id
    LEFT JOIN g ON {on} AND g.rep = r.rep
    """


def streaming_views() -> list[str]:
    """``streaming_reps``, ``streaming_kv_reps`` and ``streaming_metrics`` (module docstring)."""
    from headatlas.service.engine.results import REPLICATES
    from headatlas.service.engine.student_t import t95

    quantiles = ", ".join(f"({df}, {t95(df)!r})" for df in range(1, REPLICATES))
    keys = ("run_id", "sink", "recent", "layer", "kv_head")
    on = " AND ".join(f"h.{k} = s.{k}" for k in keys)

    def interval(name: str, low: str = "", high: str = "") -> str:
        """``name`` with its jackknife bounds, clipped to [``low``, ``high``] where given."""

        def clipped(bound: str) -> str:
            bound = f"greatest({low}, {bound})" if low else bound
            return f"least({high}, {bound})" if high else bound

        half = f"q.quantile * sqrt((j.groups - 1) * j.{name}_var)"
        held = f"j.groups >= 2 AND j.{name}_held = j.groups"
        return (
            f"t.{name}_sum / nullif(t.windows, 0) AS {name}, "
            f"CASE WHEN {held} THEN {clipped(f't.{name}_sum / nullif(t.windows, 0) - {half}')} END AS {name}_lo, "
            f"CASE WHEN {held} THEN {clipped(f't.{name}_sum / nullif(t.windows, 0) + {half}')} END AS {name}_hi"
        )

    return [
        replicated_view("streaming_reps", "streaming_effects", keys, STREAMING_SUMS),
        f"""
        CREATE VIEW streaming_kv_reps AS
        WITH shown AS ({SHOWN_RESTRICTION})
        SELECT s.run_id, s.layer, s.kv_head, s.drop_rep, greatest(1, r.n_heads // c.kv_heads) AS group_size,
               s.windows AS streaming_windows, s.effect_sum AS streaming_effect_sum,
               s.beyond_sum AS streaming_beyond_sum, s.sink AS streaming_sink, s.recent AS streaming_recent
        FROM streaming_reps s JOIN shown c USING (run_id, sink, recent) JOIN runs r ON r.run_id = s.run_id
        """,
        # the jackknife of each leave-one-group-out mean over the groups holding the restriction's
        # windows: half-width t_{R-1, 0.975} · sqrt((R - 1) · var_pop), as intervals.jackknife_interval
        f"""
        CREATE VIEW streaming_metrics AS
        WITH t AS (SELECT * EXCLUDE (drop_rep) FROM streaming_reps WHERE drop_rep = -1),
        j AS (
            SELECT s.run_id, s.sink, s.recent, s.layer, s.kv_head, count(*) AS groups,
                   count(s.effect_sum / nullif(s.windows, 0)) AS effect_held,
                   var_pop(s.effect_sum / nullif(s.windows, 0)) AS effect_var,
                   count(s.beyond_sum / nullif(s.windows, 0)) AS beyond_held,
                   var_pop(s.beyond_sum / nullif(s.windows, 0)) AS beyond_var
            FROM streaming_reps s JOIN streaming_effects h ON {on} AND h.rep = s.drop_rep
            GROUP BY s.run_id, s.sink, s.recent, s.layer, s.kv_head
        ),
        m AS (
            SELECT run_id, sink, recent, layer, kv_head, any_value(objective) AS objective,
                   max(longest) AS longest FROM streaming_effects GROUP BY ALL
        ),
        q(df, quantile) AS (VALUES {quantiles})
        SELECT t.run_id, t.sink, t.recent, t.layer, t.kv_head, t.windows, t.tokens, m.longest,
               {interval("effect")}, {interval("beyond", "0.0", "1.0")},
               m.objective, t.objective_sum / nullif(t.windows, 0) AS objective_mean, j.groups,
               c.run_id IS NOT NULL AS shown
        FROM t JOIN m USING (run_id, sink, recent, layer, kv_head)
        LEFT JOIN j USING (run_id, sink, recent, layer, kv_head)
        LEFT JOIN q ON q.df = j.groups - 1
        LEFT JOIN ({SHOWN_RESTRICTION}) c USING (run_id, sink, recent)
        """,
    ]


def metric_columns() -> str:
    """Every declared column (the installed plugins' included), over a relation of totals."""
    return ",\n        ".join(f"{c.sql} AS {c.name}" for c in all_columns())


def view_statements() -> list[str]:
    """``CREATE VIEW`` statements of DERIVED_VIEWS, in order."""
    # the installed plugins' sums (table named_head_sums) beside headatlas's own, as columns
    named = plugin_sums()
    head_sums = (*HEAD_SUMS, *(sql_name(s.name) for s in named))
    chance = ", ".join(f"c.{c}" for c in CHANCE_SUMS)
    distance = ", ".join(f"d.{c}" for c in DISTANCE_INPUTS if c not in ("mean_distance_chance", "short_range_chance"))
    streaming = ", ".join(f"s.{c}" for c in STREAMING_INPUTS)
    return [
        replicated_view("chance_reps", "run_chance", ("run_id",), CHANCE_SUMS),
        replicated_view("head_reps", pivoted_head_stats(named), ("run_id", "layer", "head"), head_sums),
        *streaming_views(),
        # one head: its sums beside the run's sums
        f"""
        CREATE VIEW head_metrics_reps AS
        WITH x AS (
            SELECT h.*, {chance}, {distance}, cd.mean_distance_chance, cd.short_range_chance, {streaming}
            FROM head_reps h JOIN chance_reps c USING (run_id, drop_rep)
            LEFT JOIN head_distance_reps d USING (run_id, layer, head, drop_rep)
            LEFT JOIN chance_distance_reps cd USING (run_id, drop_rep)
            -- each query head reads its KV head's streaming effect (grouped-query attention)
            LEFT JOIN streaming_kv_reps s ON s.run_id = h.run_id AND s.layer = h.layer
                AND s.drop_rep = h.drop_rep AND s.kv_head = h.head // s.group_size
        )
        SELECT run_id, layer, head, drop_rep, windows, pairs,
        {metric_columns()}
        FROM x
        """,
        # one layer: its heads' sums, against the run's sums once per head
        f"""
        CREATE VIEW layer_metrics_reps AS
        WITH h AS (
            SELECT run_id, layer, drop_rep, count(*) AS heads,
                   {", ".join(f"{strict_sum(c)} AS {c}" for c in head_sums)}
            FROM head_reps GROUP BY run_id, layer, drop_rep
        ),
        d AS (
            SELECT run_id, layer, drop_rep, sum(distance_sum) AS distance_sum,
                   sum(short_range_pairs) AS short_range_pairs,
                   {", ".join(f"{strict_sum(c)} AS {c}" for c in _DM)}
            FROM head_distance_reps GROUP BY run_id, layer, drop_rep
        ),
        st AS (
            SELECT run_id, layer, drop_rep,
                   {", ".join(f"{strict_sum(c)} AS {c}" for c in STREAMING_INPUTS[:3])},
                   min(streaming_sink) AS streaming_sink, min(streaming_recent) AS streaming_recent
            FROM streaming_kv_reps GROUP BY run_id, layer, drop_rep
        ),
        x AS (
            SELECT h.*, {", ".join(f"h.heads * c.{c} AS {c}" for c in CHANCE_SUMS)},
                   {distance}, cd.mean_distance_chance, cd.short_range_chance, {streaming}
            FROM h JOIN chance_reps c USING (run_id, drop_rep)
            LEFT JOIN d USING (run_id, layer, drop_rep)
            LEFT JOIN chance_distance_reps cd USING (run_id, drop_rep)
            LEFT JOIN st s USING (run_id, layer, drop_rep)
        )
        SELECT run_id, layer, drop_rep, heads,
        {metric_columns()}
        FROM x
        """,
        "CREATE VIEW chance_totals AS SELECT * EXCLUDE (drop_rep) FROM chance_reps WHERE drop_rep = -1",
        """
        CREATE VIEW head_totals AS
        SELECT h.* EXCLUDE (drop_rep), c.* EXCLUDE (run_id, drop_rep)
        FROM head_reps h JOIN chance_reps c USING (run_id, drop_rep) WHERE h.drop_rep = -1
        """,
        "CREATE VIEW head_metrics AS SELECT * EXCLUDE (drop_rep) FROM head_metrics_reps WHERE drop_rep = -1",
        "CREATE VIEW layer_metrics AS SELECT * EXCLUDE (drop_rep) FROM layer_metrics_reps WHERE drop_rep = -1",
        *series_views(),
    ]


def rebuild_views(conn: Connection) -> None:
    """Drop and create the derived views in the caller's transaction (DuckDB binds a view's
    names when it is queried, so the views that read these need no rebuild)."""
    for name in reversed(DERIVED_VIEWS):
        conn.execute(text(f"DROP VIEW IF EXISTS {name}"))
    for statement in view_statements():
        conn.execute(text(statement))
