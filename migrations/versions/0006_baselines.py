"""Honest baselines (SPEC §5b): replicate groups, chance by distance, word repetition, uniform
attention, anchors against frequency.

New columns on the additive tables; rows stored before this migration hold NULL there, and every
view turns a sum that lacks any row's value into NULL ("unavailable"), never a partial number.

Every additive table gains ``rep``, the replicate group of the windows its row sums (0..15, NULL
before this migration). The ``*_reps`` views give each run's sums twice over: ``drop_rep = -1``
is the whole run, ``drop_rep = g`` the run without group g — the delete-one-group jackknife reads
the latter (service.reports.intervals). ``head_metrics`` and ``layer_metrics`` are the ``drop_rep = -1``
rows of ``head_metrics_reps`` and ``layer_metrics_reps``, so each metric is written once.

Revision ID: 0006_baselines
Revises: 0005_database_identity
Create Date: 2026-11-30
"""

from alembic import op

revision = "0006_baselines"
down_revision = "0005_database_identity"
branch_labels = None
depends_on = None

NEW_COLUMNS = {
    "head_stats": ("rep SMALLINT", "same_word_high BIGINT", "anchor_frequent BIGINT", "anchored_windows BIGINT"),
    "run_chance": ("rep SMALLINT", "same_word_pairs BIGINT", "punct_tokens BIGINT"),
    "pair_hist": ("rep SMALLINT", "same_sentence BIGINT", "same_token BIGINT", "same_word BIGINT"),
    "dist_hist": ("rep SMALLINT", "attended BIGINT"),
    "anchors": ("anchor_is_frequent BOOLEAN",),
}

OLD_VIEWS = (
    "layer_metrics",
    "anchor_distinctness",
    "anchor_counts",
    "head_metrics",
    "head_distance",
    "chance_distance",
    "head_totals",
    "distance_totals",
    "pair_profile",
    "chance_totals",
)

HEAD_SUMS = (
    "high_pairs",
    "sim_sum_all",
    "sim_sum_high",
    "same_sentence_high",
    "same_token_high",
    "attended_high",
    "attn_to_cls",
    "attn_to_sep",
    "attn_to_punct",
    "attn_to_self",
    "attn_to_prev",
    "attn_to_next",
    "attn_entropy",
    "same_word_high",
    "anchor_frequent",
    "anchored_windows",
)
CHANCE_SUMS = (
    "windows",
    "pairs",
    "same_sentence_pairs",
    "same_token_pairs",
    "attn_rows",
    "same_word_pairs",
    "punct_tokens",
)


def strict_sum(expr: str) -> str:
    """The sum, or NULL when any row lacks a value: a partial sum must not pass for a whole one."""
    return f"CASE WHEN count({expr}) = count(*) THEN sum({expr}) END"


def replicated_view(name: str, table: str, keys: tuple[str, ...], sums: dict[str, str]) -> str:
    """``name``: per key and ``drop_rep``, the sums of the whole run (-1) and of the run without
    each replicate group g. ``sums``: output column -> table column."""
    key_list = ", ".join(keys)
    grouped = ", ".join(f"{strict_sum(col)} AS {out}" for out, col in sums.items())
    totals = ", ".join(f"{strict_sum(out)} AS {out}" for out in sums)
    on = " AND ".join(f"g.{k} = t.{k}" for k in keys)
    loo = ", ".join(f"t.{out} - coalesce(g.{out}, 0) AS {out}" for out in sums)
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
    """Every derived measure of SPEC §5 and §5b, over a relation of totals (one head, or a
    layer's heads summed with the run's chance sums scaled by the number of heads)."""
    return """
        high_pairs,
        same_sentence_high / nullif(high_pairs, 0) AS within_sentence,
        same_sentence_pairs / nullif(pairs, 0) AS within_sentence_chance,
        within_sentence / nullif(within_sentence_chance, 0) AS within_sentence_lift,
        same_sentence_dm / nullif(high_pairs, 0) AS within_sentence_chance_dm,
        within_sentence / nullif(within_sentence_chance_dm, 0) AS within_sentence_lift_dm,
        same_token_high / nullif(high_pairs, 0) AS repetition,
        same_token_pairs / nullif(pairs, 0) AS repetition_chance,
        repetition / nullif(repetition_chance, 0) AS repetition_lift,
        same_token_dm / nullif(high_pairs, 0) AS repetition_chance_dm,
        repetition / nullif(repetition_chance_dm, 0) AS repetition_lift_dm,
        same_word_high / nullif(high_pairs, 0) AS repetition_words,
        same_word_pairs / nullif(pairs, 0) AS repetition_words_chance,
        repetition_words / nullif(repetition_words_chance, 0) AS repetition_words_lift,
        same_word_dm / nullif(high_pairs, 0) AS repetition_words_chance_dm,
        repetition_words / nullif(repetition_words_chance_dm, 0) AS repetition_words_lift_dm,
        coalesce(distance_sum, 0) / nullif(high_pairs, 0) AS mean_distance,
        mean_distance_chance,
        coalesce(short_range_pairs, 0) / nullif(high_pairs, 0) AS short_range_share,
        short_range_chance,
        1 - attended_high / nullif(high_pairs, 0) AS noise_share,
        sim_sum_high / nullif(high_pairs, 0) AS sim_mean_high,
        sim_sum_all / nullif(pairs, 0) AS sim_mean_all,
        attn_to_cls / nullif(attn_rows, 0) AS attn_to_cls,
        attn_to_sep / nullif(attn_rows, 0) AS attn_to_sep,
        attn_to_punct / nullif(attn_rows, 0) AS attn_to_punct,
        attn_to_cls_sum / nullif(windows, 0) AS attn_to_cls_lift,
        attn_to_sep_sum / nullif(windows, 0) AS attn_to_sep_lift,
        attn_to_punct_sum / nullif(punct_tokens, 0) AS attn_to_punct_lift,
        attn_to_self / nullif(attn_rows, 0) AS attn_to_self,
        attn_to_prev / nullif(attn_rows, 0) AS attn_to_prev,
        attn_to_next / nullif(attn_rows, 0) AS attn_to_next,
        attn_entropy / nullif(attn_rows, 0) AS attn_entropy,
        anchor_frequent / nullif(anchored_windows, 0) AS anchor_frequency_share
    """


def dm_term(column: str) -> str:
    # high pairs at d times the share of P at d with the property (0 where no high pair is at d)
    return f"CASE WHEN d.high_pairs = 0 THEN 0 ELSE d.high_pairs * p.{column} / p.pairs END"


VIEWS = [
    # groups of a run that carry replicate sums (a run stored before 0006 has none)
    """
    CREATE VIEW run_reps AS
    WITH c AS (SELECT run_id, rep FROM run_chance GROUP BY run_id, rep)
    SELECT run_id, rep FROM c
    WHERE run_id NOT IN (SELECT run_id FROM c WHERE rep IS NULL)
    """,
    replicated_view("chance_reps", "run_chance", ("run_id",), {c: c for c in CHANCE_SUMS}),
    replicated_view(
        "pair_reps",
        "pair_hist",
        ("run_id", "distance"),
        {
            "pairs": "count",
            "same_sentence_pairs": "same_sentence",
            "same_token_pairs": "same_token",
            "same_word_pairs": "same_word",
        },
    ),
    replicated_view("head_reps", "head_stats", ("run_id", "layer", "head"), {c: c for c in HEAD_SUMS}),
    replicated_view(
        "distance_reps",
        "dist_hist",
        ("run_id", "layer", "head", "distance"),
        {"high_pairs": "count", "attended_pairs": "attended"},
    ),
    """
    CREATE VIEW chance_distance_reps AS
    SELECT p.run_id, p.drop_rep,
           sum(p.distance * p.pairs) / nullif(sum(p.pairs), 0) AS mean_distance_chance,
           sum(p.pairs) FILTER (WHERE p.distance <= r.short_range) / nullif(sum(p.pairs), 0) AS short_range_chance
    FROM pair_reps p JOIN runs r USING (run_id)
    GROUP BY p.run_id, p.drop_rep
    """,
    f"""
    CREATE VIEW head_distance_reps AS
    SELECT d.run_id, d.layer, d.head, d.drop_rep,
           sum(d.distance * d.high_pairs) AS distance_sum,
           coalesce(sum(d.high_pairs) FILTER (WHERE d.distance <= r.short_range), 0) AS short_range_pairs,
           {strict_sum(dm_term("same_sentence_pairs"))} AS same_sentence_dm,
           {strict_sum(dm_term("same_token_pairs"))} AS same_token_dm,
           {strict_sum(dm_term("same_word_pairs"))} AS same_word_dm
    FROM distance_reps d LEFT JOIN pair_reps p USING (run_id, drop_rep, distance) JOIN runs r USING (run_id)
    GROUP BY d.run_id, d.layer, d.head, d.drop_rep
    """,
    # one head: its sums beside the run's chance sums
    f"""
    CREATE VIEW head_metrics_reps AS
    WITH x AS (
        SELECT h.*, h.attn_to_cls AS attn_to_cls_sum, h.attn_to_sep AS attn_to_sep_sum,
               h.attn_to_punct AS attn_to_punct_sum,
               c.windows, c.pairs, c.same_sentence_pairs, c.same_token_pairs, c.same_word_pairs, c.attn_rows,
               c.punct_tokens, d.distance_sum, d.short_range_pairs, d.same_sentence_dm, d.same_token_dm,
               d.same_word_dm, cd.mean_distance_chance, cd.short_range_chance
        FROM head_reps h JOIN chance_reps c USING (run_id, drop_rep)
        LEFT JOIN head_distance_reps d USING (run_id, layer, head, drop_rep)
        LEFT JOIN chance_distance_reps cd USING (run_id, drop_rep)
    )
    SELECT run_id, layer, head, drop_rep, windows, pairs, {metric_columns()}
    FROM x
    """,
    # one layer: its heads' sums, against the run's chance sums once per head
    f"""
    CREATE VIEW layer_metrics_reps AS
    WITH h AS (
        SELECT run_id, layer, drop_rep, count(*) AS heads,
               {", ".join(f"{strict_sum(c)} AS {c}" for c in HEAD_SUMS)}
        FROM head_reps GROUP BY run_id, layer, drop_rep
    ),
    d AS (
        SELECT run_id, layer, drop_rep, sum(distance_sum) AS distance_sum,
               sum(short_range_pairs) AS short_range_pairs,
               {strict_sum("same_sentence_dm")} AS same_sentence_dm,
               {strict_sum("same_token_dm")} AS same_token_dm,
               {strict_sum("same_word_dm")} AS same_word_dm
        FROM head_distance_reps GROUP BY run_id, layer, drop_rep
    ),
    x AS (
        SELECT h.*, h.attn_to_cls AS attn_to_cls_sum, h.attn_to_sep AS attn_to_sep_sum,
               h.attn_to_punct AS attn_to_punct_sum,
               {", ".join(f"h.heads * c.{c} AS {c}" for c in CHANCE_SUMS)},
               d.distance_sum, d.short_range_pairs, d.same_sentence_dm, d.same_token_dm, d.same_word_dm,
               cd.mean_distance_chance, cd.short_range_chance
        FROM h JOIN chance_reps c USING (run_id, drop_rep)
        LEFT JOIN d USING (run_id, layer, drop_rep)
        LEFT JOIN chance_distance_reps cd USING (run_id, drop_rep)
    )
    SELECT run_id, layer, drop_rep, heads, {metric_columns()}
    FROM x
    """,
    # the whole run: the names earlier versions had, with the new columns
    "CREATE VIEW chance_totals AS SELECT * EXCLUDE (drop_rep) FROM chance_reps WHERE drop_rep = -1",
    "CREATE VIEW pair_profile AS SELECT * EXCLUDE (drop_rep) FROM pair_reps WHERE drop_rep = -1",
    "CREATE VIEW distance_totals AS SELECT * EXCLUDE (drop_rep) FROM distance_reps WHERE drop_rep = -1",
    """
    CREATE VIEW head_totals AS
    SELECT h.* EXCLUDE (drop_rep), c.* EXCLUDE (run_id, drop_rep)
    FROM head_reps h JOIN chance_reps c USING (run_id, drop_rep) WHERE h.drop_rep = -1
    """,
    "CREATE VIEW chance_distance AS SELECT * EXCLUDE (drop_rep) FROM chance_distance_reps WHERE drop_rep = -1",
    "CREATE VIEW head_distance AS SELECT * EXCLUDE (drop_rep) FROM head_distance_reps WHERE drop_rep = -1",
    "CREATE VIEW head_metrics AS SELECT * EXCLUDE (drop_rep) FROM head_metrics_reps WHERE drop_rep = -1",
    "CREATE VIEW layer_metrics AS SELECT * EXCLUDE (drop_rep) FROM layer_metrics_reps WHERE drop_rep = -1",
    # unchanged from 0001, re-created after the views they read
    """
    CREATE VIEW anchor_counts AS
    SELECT a.run_id, a.layer, a.head, a.token_id, any_value(a.token) AS token, sum(a.windows) AS windows,
           sum(a.windows) / any_value(c.windows) AS window_share,
           sum(a.share_sum) / sum(a.windows) AS mean_anchor_share
    FROM anchor_tokens a JOIN chance_totals c USING (run_id)
    GROUP BY a.run_id, a.layer, a.head, a.token_id
    """,
    """
    CREATE VIEW anchor_distinctness AS
    SELECT run_id, layer,
           sum(distinct_windows) / nullif(sum(windows), 0) AS distinct_share,
           sum(distinct_anchor_sum) / nullif(sum(anchored_head_sum), 0) AS distinct_anchor_ratio,
           sum(windows) AS windows
    FROM anchor_layers GROUP BY run_id, layer
    """,
]

NEW_VIEWS = (
    "anchor_distinctness",
    "anchor_counts",
    "layer_metrics",
    "head_metrics",
    "head_distance",
    "chance_distance",
    "head_totals",
    "distance_totals",
    "pair_profile",
    "chance_totals",
    "layer_metrics_reps",
    "head_metrics_reps",
    "head_distance_reps",
    "chance_distance_reps",
    "distance_reps",
    "head_reps",
    "pair_reps",
    "chance_reps",
    "run_reps",
)


def upgrade() -> None:
    for view in OLD_VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    for statement in VIEWS:
        op.execute(statement)


def downgrade() -> None:
    for view in NEW_VIEWS:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column.split()[0]}")
    import importlib.util
    from pathlib import Path

    # Alembic loads revisions by file: load the first one the same way for its views
    spec = importlib.util.spec_from_file_location("_initial", Path(__file__).with_name("0001_initial.py"))
    assert spec is not None and spec.loader is not None  # a .py file next to this one
    initial = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(initial)
    for statement in initial.VIEWS:
        op.execute(statement)
