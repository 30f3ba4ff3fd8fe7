"""Training series: one model's checkpoints analysed on the same windows (``analyze --checkpoints``).

``training_series``: a series by name, with the ``--checkpoints`` value it was made from.
``series_runs``: per series and training step, the checkpoint (its folder, or hub name and
revision) and the run that analysed it; a step names one checkpoint of its series.

The views over them (``series_head_metrics_reps``, ``series_head_metrics``: every head's metrics
and probe scores against the series' steps) are derived views, made with ``head_metrics_reps``
at the end of every upgrade (``service/storage/views.py``, ``series_rows.series_views``).

Revision ID: 0022_training_series
Revises: 0021_head_examples
Create Date: 2026-12-06
"""

from alembic import op

revision = "0022_training_series"
down_revision = "0021_head_examples"
branch_labels = None
depends_on = None

STATEMENTS = [
    "CREATE SEQUENCE series_id_seq START 1",
    """
    CREATE TABLE training_series (
        series_id INTEGER PRIMARY KEY DEFAULT nextval('series_id_seq'),
        name VARCHAR NOT NULL UNIQUE,
        checkpoints VARCHAR NOT NULL,       -- the --checkpoints value: a folder, a glob, or NAME@REV,…
        created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
    )
    """,
    """
    CREATE TABLE series_runs (
        series_id INTEGER NOT NULL,
        step BIGINT NOT NULL,               -- the training step of the checkpoint
        checkpoint VARCHAR NOT NULL,        -- its folder, or hub name@revision
        run_id INTEGER NOT NULL,
        PRIMARY KEY (series_id, step)
    )
    """,
]


def upgrade() -> None:
    for statement in STATEMENTS:
        op.execute(statement)


def downgrade() -> None:
    for statement in (
        "DROP VIEW IF EXISTS series_head_metrics",  # derived views over these tables
        "DROP VIEW IF EXISTS series_head_metrics_reps",
        "DROP TABLE IF EXISTS series_runs",
        "DROP TABLE IF EXISTS training_series",
        "DROP SEQUENCE IF EXISTS series_id_seq",
    ):
        op.execute(statement)
