"""Corpus-averaged similarity matrices (SPEC §5c) and within-sentence pairs of H by distance.

``csm_bins``: per (run, batch, layer, head, kind, cell) the sum of C_ij and the number of pairs
summed, for the pairs of P (kind ``all``) and the pairs of H that pass / fail the attention gate
(``attended`` / ``noise``); cells are bins of ``csm_bin`` positions (run parameter, default 8),
upper triangle only. Additive like every statistics table (compacted to batch_id = -1).
``run_chance.csm_windows``: windows whose matrices are stored (0 with ``--csm-bin 0``, NULL in rows
stored before this migration), so that a run whose matrices cover only some windows is known.
``dist_hist.same_sentence``: pairs of H at the distance that share a sentence (NULL before).

Views: ``csm_means`` (mean C per cell, and for attended/noise the share of the cell's pairs they
are) and ``sentence_distance`` (per head and distance: H, its within-sentence pairs, and the
chance numerator and denominator of all pairs at that distance).

Revision ID: 0007_averaged_csm
Revises: 0006_baselines
Create Date: 2026-11-30
"""

from alembic import op

revision = "0007_averaged_csm"
down_revision = "0006_baselines"
branch_labels = None
depends_on = None

NEW_COLUMNS = {
    "run_chance": ("csm_windows BIGINT",),
    "dist_hist": ("same_sentence BIGINT",),
}

TABLE = """
CREATE TABLE csm_bins (
    run_id INTEGER NOT NULL,
    batch_id INTEGER NOT NULL,
    layer SMALLINT NOT NULL,
    head SMALLINT NOT NULL,
    kind VARCHAR NOT NULL,
    bin_i SMALLINT NOT NULL,
    bin_j SMALLINT NOT NULL,
    sim_sum DOUBLE NOT NULL,
    pairs BIGINT NOT NULL
)
"""


def strict_sum(expr: str) -> str:
    """The sum, or NULL when any row lacks a value: a partial sum must not pass for a whole one."""
    return f"CASE WHEN count({expr}) = count(*) THEN sum({expr}) END"


VIEWS = [
    """
    CREATE VIEW csm_means AS
    WITH s AS (
        SELECT run_id, layer, head, kind, bin_i, bin_j, sum(pairs) AS pairs, sum(sim_sum) AS sim_sum
        FROM csm_bins GROUP BY run_id, layer, head, kind, bin_i, bin_j
    )
    SELECT s.run_id, s.layer, s.head, s.kind, s.bin_i, s.bin_j, s.pairs, s.sim_sum,
           s.sim_sum / nullif(s.pairs, 0) AS mean,
           s.pairs / nullif(a.pairs, 0) AS pair_share
    FROM s LEFT JOIN s a ON a.run_id = s.run_id AND a.layer = s.layer AND a.head = s.head AND a.kind = 'all'
                        AND a.bin_i = s.bin_i AND a.bin_j = s.bin_j
    """,
    f"""
    CREATE VIEW sentence_distance AS
    WITH h AS (
        SELECT run_id, layer, head, distance, sum(count) AS high_pairs,
               {strict_sum("same_sentence")} AS same_sentence_high
        FROM dist_hist GROUP BY run_id, layer, head, distance
    )
    SELECT h.run_id, h.layer, h.head, h.distance, h.high_pairs, h.same_sentence_high,
           p.pairs, p.same_sentence_pairs
    FROM h LEFT JOIN pair_profile p USING (run_id, distance)
    """,
]


def upgrade() -> None:
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} ADD COLUMN {column}")
    op.execute(TABLE)
    for statement in VIEWS:
        op.execute(statement)


def downgrade() -> None:
    for view in ("sentence_distance", "csm_means"):
        op.execute(f"DROP VIEW IF EXISTS {view}")
    op.execute("DROP TABLE IF EXISTS csm_bins")
    for table, columns in NEW_COLUMNS.items():
        for column in columns:
            op.execute(f"ALTER TABLE {table} DROP COLUMN {column.split()[0]}")
