"""The synthetic probe (SPEC §8): induction, duplicate-token and previous-token scores per head.

Revision ID: 0010_probe
Revises: 0009_decoder_metrics
Create Date: 2026-11-30
"""

revision = "0010_probe"
down_revision = "0009_decoder_metrics"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
