"""Distributed runs: the batch plan of a queued run.

A queued run is cut into a fixed number of batches of a fixed size when it is first submitted;
the plan is what the writer compares the batch ledger (``batches``) with to know that the run
has ended, and what a re-submission reuses so that batch ids keep naming the same windows.
A new table rather than columns on ``runs``: DuckDB cannot ALTER a table that has an index.

Revision ID: 0003_queue
Revises: 0002_mixing
Create Date: 2026-11-29
"""

from alembic import op

revision = "0003_queue"
down_revision = "0002_mixing"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE queue_plans (
            run_id INTEGER PRIMARY KEY,
            batch_size INTEGER NOT NULL,
            batches INTEGER,  -- NULL until the submitter has cut the whole corpus
            windows BIGINT,
            submitted_at TIMESTAMP NOT NULL DEFAULT current_timestamp
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS queue_plans")
