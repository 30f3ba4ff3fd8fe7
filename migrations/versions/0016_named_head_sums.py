"""Per-head sums by name: those of a measure or metric installed beside headatlas (a plugin).

``named_head_sums``: one row per (run, batch, replicate group, layer, head) and sum name, the
value a ``DOUBLE``. A batch result's head sum that is not a column of ``head_stats`` (named
``"<measure>.<sum>"``) is stored here, summed per replicate group like ``head_stats``'s own
(service/storage/batch_rows.py) and folded by compaction alike (``rep, layer, head, name`` its
keys). A plugin metric's declared sums are read from it by the views, pivoted into columns of
their own name (service/storage/views.py); a sum nobody declares is stored and readable
(service/storage/named_sums.py) all the same.

One narrow table rather than a column per sum: the tables change only by headatlas's own
migrations, which never change after they land, so a plugin never ships DDL; installing or
removing one changes no table, and ``db upgrade`` rebuilds the views from what is installed.

Revision ID: 0016_named_head_sums
Revises: 0015_run_results
Create Date: 2026-12-05
"""

from alembic import op

revision = "0016_named_head_sums"
down_revision = "0015_run_results"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE named_head_sums (
            run_id INTEGER NOT NULL,
            batch_id INTEGER NOT NULL,
            rep SMALLINT NOT NULL,
            layer SMALLINT NOT NULL,
            head SMALLINT NOT NULL,
            name VARCHAR NOT NULL,      -- "<measure>.<sum>"
            value DOUBLE NOT NULL       -- the sum over the batch's windows of the group
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS named_head_sums")
