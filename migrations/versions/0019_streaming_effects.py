"""Streaming effects of key-value heads (SPEC §10), stored by ``headatlas effects RUN --streaming``.

``streaming_effects``: per run, restriction (``sink`` S, ``recent`` W), replicate group (SPEC §5d),
layer and KV head, additive sums over the windows measured: ``windows`` and ``tokens`` (their
count and summed length n), ``longest`` (the longest window's n), ``effect_sum`` (Σ_w σ(w), σ =
O with the KV head streaming − O intact), ``beyond_sum`` (Σ_w of the head's attention mass beyond
sinks + W in the intact pass), ``objective_sum`` (Σ_w O(w) intact), and ``objective`` (its name).
A restriction measured again replaces its rows.

Revision ID: 0019_streaming_effects
Revises: 0018_prune_retrieval
Create Date: 2026-12-06
"""

from alembic import op

revision = "0019_streaming_effects"
down_revision = "0018_prune_retrieval"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE streaming_effects (
        run_id INTEGER NOT NULL,
        sink INTEGER NOT NULL,              -- S: the first S tokens stay visible
        recent INTEGER NOT NULL,            -- W: and the W most recent keys (the query's own included)
        rep INTEGER NOT NULL,               -- replicate group (SPEC §5d)
        layer INTEGER NOT NULL,
        kv_head INTEGER NOT NULL,
        objective VARCHAR NOT NULL,
        windows INTEGER NOT NULL,
        tokens BIGINT NOT NULL,             -- Σ n over the windows
        longest INTEGER NOT NULL,           -- the longest window's n
        effect_sum DOUBLE NOT NULL,         -- Σ σ(w)
        beyond_sum DOUBLE NOT NULL,         -- Σ attention mass beyond sinks + W
        objective_sum DOUBLE NOT NULL,      -- Σ O(w), intact
        PRIMARY KEY (run_id, sink, recent, rep, layer, kv_head)
    )
    """,
]


def upgrade() -> None:
    for statement in TABLES:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS streaming_effects")
