"""Database identity: a random id stored once, when the database is created or upgraded.

Anything kept outside the database on its behalf (the broker's dedup keys, a writer's lease on
an ingest queue) is scoped by this id, so a replaced or new database file never inherits the
state of another one that used the same broker.

Revision ID: 0005_database_identity
Revises: 0004_schedules
Create Date: 2026-11-30
"""

from alembic import op

revision = "0005_database_identity"
down_revision = "0004_schedules"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE database_info (
            key VARCHAR PRIMARY KEY,
            value VARCHAR NOT NULL
        )
        """
    )
    op.execute("INSERT INTO database_info VALUES ('database_id', CAST(uuid() AS VARCHAR))")


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS database_info")
