"""Replicate groups by document (SPEC §5d).

Revision ID: 0008_replicates
Revises: 0007_averaged_csm
Create Date: 2026-11-30
"""

revision = "0008_replicates"
down_revision = "0007_averaged_csm"
branch_labels = None
depends_on = None


def upgrade() -> None:
    pass


def downgrade() -> None:
    pass
