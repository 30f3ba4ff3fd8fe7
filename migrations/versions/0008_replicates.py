"""Replicate groups by document (SPEC §5d): no schema change.

The replicate scheme a run used (``document``, ``block:B``) is recorded in its ``params`` JSON,
and every additive table already keeps its rows per group (``rep``, 0006), so runs stored before
need nothing: they have no scheme recorded and their intervals say "by window". The revision
marks the point from which a database may hold runs grouped by document.

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
