"""Mixing measures: attention, gradient attribution, rollout, norm-based, ALTI (SPEC §6).

Additive partial sums keyed by (run_id, batch_id, method, layer, head), like head_stats;
head -1 is the layer-level row (mean attention, block-output attribution, layer rollout,
layer norm-based, ALTI). Views sum the batches and divide by the rows.

Revision ID: 0002_mixing
Revises: 0001
Create Date: 2026-11-30
"""

from alembic import op

revision = "0002_mixing"
down_revision = "0001"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE mixing_stats (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        method VARCHAR NOT NULL,
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        windows BIGINT NOT NULL,
        rows BIGINT NOT NULL,
        to_cls DOUBLE NOT NULL,
        to_sep DOUBLE NOT NULL,
        to_punct DOUBLE NOT NULL,
        to_self DOUBLE NOT NULL,
        to_prev DOUBLE NOT NULL,
        to_next DOUBLE NOT NULL,
        entropy DOUBLE NOT NULL,
        jsd_attention DOUBLE NOT NULL,
        distance_sum DOUBLE NOT NULL
    )
    """,
    """
    CREATE TABLE mixing_dist (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        method VARCHAR NOT NULL,
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        distance SMALLINT NOT NULL,
        mass DOUBLE NOT NULL
    )
    """,
]

VIEWS = [
    """
    CREATE VIEW mixing_metrics AS
    SELECT run_id, method, layer, head,
           sum(windows) AS windows, sum(rows) AS rows,
           sum(to_self) / nullif(sum(rows), 0) AS to_self,
           sum(to_prev) / nullif(sum(rows), 0) AS to_prev,
           sum(to_next) / nullif(sum(rows), 0) AS to_next,
           sum(to_cls) / nullif(sum(rows), 0) AS to_cls,
           sum(to_sep) / nullif(sum(rows), 0) AS to_sep,
           sum(to_punct) / nullif(sum(rows), 0) AS to_punct,
           sum(entropy) / nullif(sum(rows), 0) AS entropy,
           sum(jsd_attention) / nullif(sum(rows), 0) AS jsd_attention,
           sum(distance_sum) / nullif(sum(rows), 0) AS mean_distance
    FROM mixing_stats GROUP BY run_id, method, layer, head
    """,
    """
    CREATE VIEW mixing_distance AS
    SELECT d.run_id, d.method, d.layer, d.head, d.distance, sum(d.mass) AS mass
    FROM mixing_dist d GROUP BY d.run_id, d.method, d.layer, d.head, d.distance
    """,
]


def upgrade() -> None:
    for statement in TABLES + VIEWS:
        op.execute(statement)


def downgrade() -> None:
    for view in ("mixing_distance", "mixing_metrics"):
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table in ("mixing_dist", "mixing_stats"):
        op.execute(f"DROP TABLE IF EXISTS {table}")
