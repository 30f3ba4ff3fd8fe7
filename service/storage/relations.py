"""The tables and views of a results database that SQL may read, named for ``headatlas sql --help``
(tests/test_cli_sql.py checks the lists against a new database, so they cannot drift)."""

from __future__ import annotations

# views: computed from the stored sums when queried (SPEC §5), never stored twice
VIEWS = (
    "head_metrics",  # per head: every metric (`headatlas metrics` defines each)
    "layer_metrics",  # per layer: every metric
    "head_totals",
    "chance_totals",
    "pair_profile",
    "distance_totals",
    "head_distance",
    "chance_distance",
    "sentence_distance",
    "anchor_counts",
    "anchor_distinctness",
    "csm_means",
    "mixing_metrics",
    "mixing_distance",
    "streaming_metrics",  # per run, restriction (S, W), layer and KV head: streaming effect with its interval (SPEC §10)
    "examples",  # per run, layer, head and kind: the top examples, ranked, with their window's document
    "roles",  # per run, head and role: the stored roles of a finished run, while current (SPEC §7)
    "series_head_metrics",  # per training series, step and head: every metric and probe score
)
# the same per replicate group left out (drop_rep = g; -1: the whole run): the intervals' input
REP_VIEWS = (
    "head_metrics_reps",
    "layer_metrics_reps",
    "head_reps",
    "chance_reps",
    "distance_reps",
    "pair_reps",
    "head_distance_reps",
    "chance_distance_reps",
    "run_reps",
    "streaming_reps",
    "streaming_kv_reps",
    "series_head_metrics_reps",
)
TABLES = (
    "runs",
    "run_aliases",
    "run_tags",
    "documents",
    "windows",
    "run_windows",
    "batches",
    "head_stats",
    "named_head_sums",
    "run_chance",
    "dist_hist",
    "pair_hist",
    "anchors",
    "anchor_tokens",
    "anchor_layers",
    "csm_bins",
    "mixing_stats",
    "mixing_dist",
    "probe_scores",
    "run_effects",
    "prunes",
    "prune_curves",
    "streaming_effects",
    "head_examples",
    "example_windows",
    "streaming_curves",
    "streaming_curve_steps",
    "run_results",
    "role_results",
    "queue_plans",
    "schedules",
    "schedule_fires",
    "schedule_documents",
    "schedule_fire_leases",
    "schedule_fire_documents",
    "database_info",
    "training_series",
    "series_runs",
)


def sql_help() -> str:
    """The relations, as ``headatlas sql --help`` lists them."""
    return (
        f"Views: {', '.join(VIEWS)}; each without one replicate group (drop_rep): {', '.join(REP_VIEWS)}. "
        f"Tables: {', '.join(TABLES)}. `DESCRIBE head_metrics` lists a relation's columns."
    )
