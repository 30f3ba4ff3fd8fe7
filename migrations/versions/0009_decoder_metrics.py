"""Decoder metrics (SPEC §8): per-head sums declared once.

Revision ID: 0009_decoder_metrics
Revises: 0008_replicates
Create Date: 2026-11-30
"""

revision = "0009_decoder_metrics"
down_revision = "0008_replicates"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
