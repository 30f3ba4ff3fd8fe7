"""Neighbour retrieval beside an embedding objective on a pruning curve (SPEC §9).

New columns (NULL in prunes stored before this migration, and in prunes whose objective has no
downstream measure: a loss, a decoder's drift; the prune then shows none of them):

- ``prune_curves``: ``top1``, ``top1_lo``, ``top1_hi``, ``mrr``, ``mrr_lo``, ``mrr_hi`` (each
  evaluation-window sentence, embedded alone, queries the sentences that follow another in their
  window for its own successor: the share ranked first and the mean reciprocal rank, with the
  jackknife's 95% interval over the queries' replicate groups).
- ``prunes``: ``retrieval_queries``, ``retrieval_candidates`` (the task's size) and
  ``chance_top1``, ``chance_mrr`` (the scores of a ranking at random).

Revision ID: 0018_prune_retrieval
Revises: 0017_effect_atp
Create Date: 2026-12-06
"""

from alembic import op

revision = "0018_prune_retrieval"
down_revision = "0017_effect_atp"
branch_labels = None
depends_on = None

NEW_COLUMNS = {
    "prune_curves": tuple(f"{name} DOUBLE" for name in ("top1", "top1_lo", "top1_hi", "mrr", "mrr_lo", "mrr_hi")),
    "prunes": (
        "retrieval_queries INTEGER",
        "retrieval_candidates INTEGER",
        "chance_top1 DOUBLE",
        "chance_mrr DOUBLE",
    ),
}


def upgrade() -> None:
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {column}")


def downgrade() -> None:
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column.split()[0]}")
