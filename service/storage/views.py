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

The distance views they join (``pair_reps``, ``distance_reps``, ``head_distance_reps``,
``chance_distance_reps``, …) and ``run_reps`` stay as their migrations made them.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.engine import Connection

from headatlas.service.metrics import CHANCE_SUMS, DISTANCE_INPUTS, HEAD_SUMS, all_columns, plugin_sums, sql_name
from headatlas.service.storage.named_sums import pivoted_head_stats

# created in this order, dropped in the reverse
DERIVED_VIEWS = (
    "chance_reps",
    "head_reps",
    "head_metrics_reps",
    "layer_metrics_reps",
    "chance_totals",
    "head_totals",
    "head_metrics",
    "layer_metrics",
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
    return [
        replicated_view("chance_reps", "run_chance", ("run_id",), CHANCE_SUMS),
        replicated_view("head_reps", pivoted_head_stats(named), ("run_id", "layer", "head"), head_sums),
        # one head: its sums beside the run's sums
        f"""
        CREATE VIEW head_metrics_reps AS
        WITH x AS (
            SELECT h.*, {chance}, {distance}, cd.mean_distance_chance, cd.short_range_chance
            FROM head_reps h JOIN chance_reps c USING (run_id, drop_rep)
            LEFT JOIN head_distance_reps d USING (run_id, layer, head, drop_rep)
            LEFT JOIN chance_distance_reps cd USING (run_id, drop_rep)
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
        x AS (
            SELECT h.*, {", ".join(f"h.heads * c.{c} AS {c}" for c in CHANCE_SUMS)},
                   {distance}, cd.mean_distance_chance, cd.short_range_chance
            FROM h JOIN chance_reps c USING (run_id, drop_rep)
            LEFT JOIN d USING (run_id, layer, drop_rep)
            LEFT JOIN chance_distance_reps cd USING (run_id, drop_rep)
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
    ]


def rebuild_views(conn: Connection) -> None:
    """Drop and create the derived views in the caller's transaction (DuckDB binds a view's
    names when it is queried, so the views that read these need no rebuild)."""
    for name in reversed(DERIVED_VIEWS):
        conn.execute(text(f"DROP VIEW IF EXISTS {name}"))
    for statement in view_statements():
        conn.execute(text(statement))
