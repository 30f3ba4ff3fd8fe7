"""Recurring analyses: schedules and the record of each fire.

``schedule_fires`` is keyed by (schedule, fire time): the beat process claims a fire by
inserting its row, so a fire creates at most one run even when two beat processes run or a
tick is handled twice (the second insert finds the key taken and does nothing).
``schedule_documents`` lists the documents (content ids) a schedule has already sent for
analysis, for ``only_new`` schedules; they are written in the transaction that claims the fire.

Revision ID: 0004_schedules
Revises: 0003_queue
Create Date: 2026-11-29
"""

from alembic import op

revision = "0004_schedules"
down_revision = "0003_queue"
branch_labels = None
depends_on = None

STATEMENTS = [
    "CREATE SEQUENCE schedule_id_seq START 1",
    """
    CREATE TABLE schedules (
        schedule_id INTEGER PRIMARY KEY DEFAULT nextval('schedule_id_seq'),
        name VARCHAR NOT NULL UNIQUE,
        corpus VARCHAR NOT NULL,          -- a file, directory or glob, as resolved when added
        model VARCHAR NOT NULL,
        dtype VARCHAR NOT NULL,
        batch_size INTEGER NOT NULL,
        params JSON NOT NULL,             -- AnalysisParams.to_dict()
        cron VARCHAR,                     -- exactly one of cron / every_s is set
        every_s BIGINT,
        timezone VARCHAR NOT NULL,
        enabled BOOLEAN NOT NULL,
        only_new BOOLEAN NOT NULL,
        anchor TIMESTAMP NOT NULL,        -- UTC; interval fires fall on anchor + k * every_s
        last_fire TIMESTAMP,              -- UTC
        next_fire TIMESTAMP NOT NULL,     -- UTC
        created_at TIMESTAMP NOT NULL DEFAULT current_timestamp
    )
    """,
    """
    CREATE TABLE schedule_fires (
        schedule_id INTEGER NOT NULL,
        fire_time TIMESTAMP NOT NULL,     -- UTC, the scheduled time (run-now: the time asked)
        kind VARCHAR NOT NULL,            -- scheduled | manual
        claimed_at TIMESTAMP NOT NULL,
        status VARCHAR NOT NULL,          -- claimed | submitted | no_new_documents | error
        run_key VARCHAR,
        run_name VARCHAR,
        documents INTEGER,
        error VARCHAR,
        PRIMARY KEY (schedule_id, fire_time)
    )
    """,
    """
    CREATE TABLE schedule_documents (
        schedule_id INTEGER NOT NULL,
        doc_id VARCHAR NOT NULL,
        fire_time TIMESTAMP NOT NULL,
        PRIMARY KEY (schedule_id, doc_id)
    )
    """,
]


def upgrade() -> None:
    for statement in STATEMENTS:
        op.execute(statement)


def downgrade() -> None:
    for statement in (
        "DROP TABLE IF EXISTS schedule_documents",
        "DROP TABLE IF EXISTS schedule_fires",
        "DROP TABLE IF EXISTS schedules",
        "DROP SEQUENCE IF EXISTS schedule_id_seq",
    ):
        op.execute(statement)
