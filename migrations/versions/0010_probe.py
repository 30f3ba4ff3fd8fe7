"""The synthetic probe (SPEC §8): induction, duplicate-token and previous-token scores per head.

``probe_scores``: per (run, layer, head) the three scores of the probe on repeated random tokens,
with the probe's parameters (``length`` = L, ``sequences``, ``seed``) on every row. One probe per
run: not additive, never compacted; a run without a probe has no rows here.

Revision ID: 0010_probe
Revises: 0009_decoder_metrics
Create Date: 2026-11-30
"""

from alembic import op

revision = "0010_probe"
down_revision = "0009_decoder_metrics"
branch_labels = None
depends_on = None

TABLE = """
CREATE TABLE probe_scores (
    run_id INTEGER NOT NULL,
    layer SMALLINT NOT NULL,
    head SMALLINT NOT NULL,
    length INTEGER NOT NULL,
    sequences INTEGER NOT NULL,
    seed BIGINT NOT NULL,
    induction_score DOUBLE NOT NULL,
    duplicate_score DOUBLE NOT NULL,
    prev_token_score DOUBLE NOT NULL,
    PRIMARY KEY (run_id, layer, head)
)
"""


def upgrade() -> None:
    op.execute(TABLE)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS probe_scores")
