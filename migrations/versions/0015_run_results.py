"""A finished run's derived results, stored once (service/storage/run_results.py).

``run_results``: per run and kind (``heads``, ``roles``, ``layers``), the columns and rows the
library returns (JSON), under the run's content fingerprint and the derivation (the code) that
made them. ``role_results``: the roles again as typed rows, for SQL: the ``roles`` view (derived,
rebuilt at the end of every upgrade) shows those of the runs whose stored results are current.
``headatlas db upgrade`` fills them for the finished runs stored before.

Revision ID: 0015_run_results
Revises: 0014_prune_curves
Create Date: 2026-12-03
"""

from alembic import op

revision = "0015_run_results"
down_revision = "0014_prune_curves"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE run_results (
        run_id INTEGER NOT NULL,
        kind VARCHAR NOT NULL,              -- heads, roles, layers
        fingerprint VARCHAR NOT NULL,       -- the run's content when they were derived
        derivation VARCHAR NOT NULL,        -- the code that derived them
        stored_at TIMESTAMP NOT NULL,
        columns VARCHAR NOT NULL,           -- JSON: the column names
        rows VARCHAR NOT NULL,              -- JSON: the rows, as the library returns them
        PRIMARY KEY (run_id, kind)
    )
    """,
    """
    CREATE TABLE role_results (
        run_id INTEGER NOT NULL,
        ordinal INTEGER NOT NULL,           -- the row's place in `query roles`
        layer INTEGER NOT NULL,
        head INTEGER NOT NULL,
        role VARCHAR NOT NULL,
        is_primary BOOLEAN,                 -- `primary` in the roles view (a keyword here)
        metric VARCHAR,
        value DOUBLE,
        value_lo DOUBLE,
        value_hi DOUBLE,
        threshold DOUBLE,
        test VARCHAR,
        p DOUBLE,
        p_holm DOUBLE,
        family INTEGER,
        probe_score DOUBLE,
        probe_min DOUBLE,
        rule VARCHAR,
        half_a BOOLEAN,
        half_b BOOLEAN,
        stable BOOLEAN,
        PRIMARY KEY (run_id, ordinal)
    )
    """,
]


def upgrade() -> None:
    for statement in TABLES:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS roles")
    op.execute("DROP TABLE IF EXISTS role_results")
    op.execute("DROP TABLE IF EXISTS run_results")
