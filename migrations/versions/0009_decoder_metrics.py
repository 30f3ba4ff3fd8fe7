"""Decoder metrics (SPEC §8): per-head sums declared once.

New sums (NULL in rows stored before this migration; the views read a NULL as "unavailable",
except that the uniform expectations fall back to the counts that are exact for bidirectional
attention, the only kind stored before):

- ``head_stats``: ``attn_to_first`` (weight on position 0: [CLS], or BOS in a decoder),
  ``attn_dup`` (weight on earlier copies of the query token), ``attn_induction`` (weight on the
  tokens that followed its earlier copies).
- ``run_chance``: the uniform-attention sums over each row's visible keys ``uniform_cls``,
  ``uniform_sep``, ``uniform_punct``, ``uniform_first``; ``next_rows`` (rows whose next token is
  visible: 0 for causal attention); ``dup_rows``, ``attn_dup_chance``, ``induction_rows``,
  ``attn_induction_chance``.

Views: from this revision on, the metric views are derived from the declarations
(``service.metrics``) and rebuilt at the end of every upgrade (``migrations/env.py``,
``service.storage.views``). Downgrading puts back migration 0006's versions of them.

Revision ID: 0009_decoder_metrics
Revises: 0008_replicates
Create Date: 2026-11-30
"""

from alembic import op

revision = "0009_decoder_metrics"
down_revision = "0008_replicates"
branch_labels = None
depends_on = None

NEW_COLUMNS = {
    "head_stats": ("attn_to_first DOUBLE", "attn_dup DOUBLE", "attn_induction DOUBLE"),
    "run_chance": (
        "uniform_cls DOUBLE",
        "uniform_sep DOUBLE",
        "uniform_punct DOUBLE",
        "uniform_first DOUBLE",
        "next_rows BIGINT",
        "dup_rows BIGINT",
        "attn_dup_chance DOUBLE",
        "induction_rows BIGINT",
        "attn_induction_chance DOUBLE",
    ),
}

# the views 0006 wrote by hand that are now derived (service.storage.views.DERIVED_VIEWS)
DERIVED = (
    "layer_metrics",
    "head_metrics",
    "head_totals",
    "chance_totals",
    "layer_metrics_reps",
    "head_metrics_reps",
    "head_reps",
    "chance_reps",
)


def upgrade() -> None:
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def downgrade() -> None:
    import importlib.util
    from pathlib import Path

    for view in DERIVED:
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column.split()[0]}")
    # Alembic loads revisions by file: load 0006 the same way for its versions of the views
    spec = importlib.util.spec_from_file_location("_baselines", Path(__file__).with_name("0006_baselines.py"))
    assert spec is not None and spec.loader is not None  # a .py file next to this one
    baselines = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baselines)
    for statement in baselines.VIEWS:
        name = statement.split("CREATE VIEW", 1)[1].split()[0]
        if name in DERIVED:
            op.execute(statement)
