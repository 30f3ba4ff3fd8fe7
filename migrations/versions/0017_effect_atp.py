"""Attribution patching (SPEC §9): the first-order estimate of each head's mean-ablation effect.

New sum (NULL in rows stored before this migration, and in runs without ``--effects atp``; the
views read a NULL as "unavailable"):

- ``head_stats``: ``effect_atp`` (Σ over a run's effect windows of Σ_i (m − z_i) · ∂O/∂z_i, the
  head's output z at position i, m its reference mean), per replicate group like every other sum.

``run_effects`` needs no change: its ``kinds`` lists ``atp`` among the others, and its reference
set is the one mean ablation uses.

Revision ID: 0017_effect_atp
Revises: 0016_named_head_sums
Create Date: 2026-12-05
"""

from alembic import op

revision = "0017_effect_atp"
down_revision = "0016_named_head_sums"
branch_labels = None
depends_on = None

NEW_COLUMNS = {"head_stats": ("effect_atp DOUBLE",)}


def upgrade() -> None:
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def downgrade() -> None:
    from headatlas.service.storage.views import DERIVED_VIEWS

    for view in reversed(DERIVED_VIEWS):  # they read the column dropped below; rebuilt at the next upgrade
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column.split()[0]}")
