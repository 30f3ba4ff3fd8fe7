"""Pruning curves (SPEC §9), stored by ``headatlas prune``.

``prunes``: one row per stored prune of a run: how it was made (orders, step, seeds, evaluation
windows, where the effect and importance orders came from, the reference windows of mean
ablation, the replicate scheme and groups of its intervals) and the test of the seed paper's claim
(the area between the noise-ordered curve and the random ones, Spearman's ρ between noise_share
and the effect, each with its 95% interval, and the verdict in words).
``prune_curves``: per prune, order and step, the heads removed so far, the objective on the
evaluation windows and its increase over the intact model, each with its interval, and the heads
removed at that step (``layer.head``, space-separated).

Revision ID: 0014_prune_curves
Revises: 0013_effects
Create Date: 2026-12-02
"""

from alembic import op

revision = "0014_prune_curves"
down_revision = "0013_effects"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE prunes (
        run_id INTEGER NOT NULL,
        prune_id INTEGER NOT NULL,
        created_at TIMESTAMP NOT NULL,
        objective VARCHAR NOT NULL,
        unit VARCHAR NOT NULL,
        orders VARCHAR NOT NULL,            -- comma-separated, as asked
        step DOUBLE NOT NULL,               -- share of the heads removed per step
        seeds INTEGER NOT NULL,             -- random orders
        evaluation_windows INTEGER NOT NULL,
        selection VARCHAR NOT NULL,         -- where the effect/importance orders came from
        reference_windows INTEGER NOT NULL, -- mean ablation's reference set
        scheme VARCHAR NOT NULL,            -- replicate scheme of the intervals (SPEC §5d)
        groups INTEGER NOT NULL,
        area DOUBLE, area_lo DOUBLE, area_hi DOUBLE,  -- noise − random, objective unit × share removed
        rho DOUBLE, rho_lo DOUBLE, rho_hi DOUBLE,     -- Spearman ρ(noise_share, effect)
        claim VARCHAR NOT NULL,             -- the verdict in words, with the figures
        seconds DOUBLE NOT NULL,
        PRIMARY KEY (run_id, prune_id)
    )
    """,
    """
    CREATE TABLE prune_curves (
        run_id INTEGER NOT NULL,
        prune_id INTEGER NOT NULL,
        order_name VARCHAR NOT NULL,        -- effect, importance, noise, random:SEED
        step INTEGER NOT NULL,
        heads_removed INTEGER NOT NULL,
        fraction DOUBLE NOT NULL,
        objective DOUBLE, objective_lo DOUBLE, objective_hi DOUBLE,
        increase DOUBLE, increase_lo DOUBLE, increase_hi DOUBLE,
        removed VARCHAR NOT NULL,           -- the heads removed at this step: layer.head, space-separated
        PRIMARY KEY (run_id, prune_id, order_name, step)
    )
    """,
]


def upgrade() -> None:
    for statement in TABLES:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS prune_curves")
    op.execute("DROP TABLE IF EXISTS prunes")
