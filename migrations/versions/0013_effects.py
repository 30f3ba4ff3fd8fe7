"""Causal effects of heads (SPEC §9): their additive sums, and what each run's effects are measured against.

New sums (NULL in rows stored before this migration, and in runs without ``--effects``; the views
read a NULL as "unavailable"):

- ``head_stats``: ``effect_zero``, ``effect_mean`` (Σ over a run's effect windows of
  O(ablated) − O(intact)), ``importance`` (Σ |∂O/∂ξ|), ``drift_zero``, ``drift_mean`` (Σ output
  drift), per replicate group like every other sum.
- ``run_chance``: ``effect_windows`` (windows measured), ``objective`` (Σ O of the intact model).

``run_effects``: per run, what its effects are measured against — the objective and its unit, the
kinds, and the reference set of mean ablation (its window count, the fingerprint of its window
ids, the valid positions averaged) with the fingerprint of the means used. One row per distinct
set of means a run's batches used (one, unless its means were computed twice and differed).

Revision ID: 0013_effects
Revises: 0012_fire_leases
Create Date: 2026-12-02
"""

from alembic import op

revision = "0013_effects"
down_revision = "0012_fire_leases"
branch_labels = None
depends_on = None

NEW_COLUMNS = {
    "head_stats": (
        "effect_zero DOUBLE",
        "effect_mean DOUBLE",
        "importance DOUBLE",
        "drift_zero DOUBLE",
        "drift_mean DOUBLE",
    ),
    "run_chance": ("effect_windows BIGINT", "objective DOUBLE"),
}

TABLE = """
CREATE TABLE run_effects (
    run_id INTEGER NOT NULL,
    objective VARCHAR NOT NULL,          -- next_token_loss, masked_lm_loss or embedding_drift
    unit VARCHAR NOT NULL,               -- nats, or 1 - cos
    kinds VARCHAR NOT NULL,              -- comma-separated: zero, mean, gradient
    reference_windows INTEGER NOT NULL,  -- mean ablation: the run's first N windows (0 without it)
    reference_positions BIGINT NOT NULL, -- valid positions the means average
    reference_fingerprint VARCHAR NOT NULL,  -- hash of the reference windows' ids, in order
    means_fingerprint VARCHAR NOT NULL,  -- hash of the means' float64 bytes ('' without mean ablation)
    PRIMARY KEY (run_id, means_fingerprint)
)
"""


def upgrade() -> None:
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    op.execute(TABLE)


def downgrade() -> None:
    from headatlas.service.storage.views import DERIVED_VIEWS

    for view in reversed(DERIVED_VIEWS):  # they read the columns dropped below; rebuilt at the next upgrade
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.execute("DROP TABLE IF EXISTS run_effects")
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column.split()[0]}")
