"""Run labels: aliases (more names of one run) and tags (free labels shared by runs).

``run_aliases``: a name that resolves to a run as its own name does (``--run ALIAS``), e.g. the
name an identical analysis was asked for. Names and aliases are unique together, across runs
(checked by the store, in the transaction that adds one); the primary key keeps an alias to one run.
``run_tags``: labels to group and filter runs (``headatlas runs --tag T``); many runs may share a
tag, and a tag never resolves to a run.

Revision ID: 0011_run_labels
Revises: 0010_probe
Create Date: 2026-12-01
"""

from alembic import op

revision = "0011_run_labels"
down_revision = "0010_probe"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE run_aliases (
        alias VARCHAR PRIMARY KEY,
        run_id INTEGER NOT NULL,
        created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
    )
    """,
    """
    CREATE TABLE run_tags (
        run_id INTEGER NOT NULL,
        tag VARCHAR NOT NULL,
        created_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
        PRIMARY KEY (run_id, tag)
    )
    """,
]


def upgrade() -> None:
    for statement in TABLES:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS run_tags")
    op.execute("DROP TABLE IF EXISTS run_aliases")
