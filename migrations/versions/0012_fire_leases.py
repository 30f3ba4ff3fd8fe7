"""Fires in hand: who holds a claimed fire until when, and the documents it sends.

``schedule_fire_leases``: the beat (or `schedule run-now`) submitting a claimed fire, and when its
hold ends; the holder renews it while it submits. A fire still ``claimed`` whose lease has run out
(its beat died between the claim and the end of its submission) is taken over by the next beat
that claims a fire of its schedule, and submitted again: the submission is idempotent, so a run
left half queued is completed rather than left running.
``schedule_fire_documents``: an ``only_new`` fire's documents (content ids), fixed when it is
first claimed, so a fire taken over sends the same documents. They move to
``schedule_documents`` (sent, never sent again) only when the fire's run is submitted.

Revision ID: 0012_fire_leases
Revises: 0011_run_labels
Create Date: 2026-12-02
"""

from alembic import op

revision = "0012_fire_leases"
down_revision = "0011_run_labels"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE schedule_fire_leases (
        schedule_id INTEGER NOT NULL,
        fire_time TIMESTAMP NOT NULL,
        holder VARCHAR NOT NULL,          -- host:pid:token of the process submitting the fire
        lease_until TIMESTAMP NOT NULL,   -- UTC; after it, another beat may take the fire over
        PRIMARY KEY (schedule_id, fire_time)
    )
    """,
    """
    CREATE TABLE schedule_fire_documents (
        schedule_id INTEGER NOT NULL,
        fire_time TIMESTAMP NOT NULL,
        doc_id VARCHAR NOT NULL,
        PRIMARY KEY (schedule_id, fire_time, doc_id)
    )
    """,
]


def upgrade() -> None:
    for statement in TABLES:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS schedule_fire_documents")
    op.execute("DROP TABLE IF EXISTS schedule_fire_leases")
