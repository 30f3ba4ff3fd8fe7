"""Memory curves of streaming KV heads (SPEC §10), stored by ``headatlas prune RUN --streaming``.

``streaming_curves``: one row per stored memory curve of a run: the restriction (``sink`` S,
``recent`` W), how it was made (orders, step, seeds, the objective), the KV cache's shape (layers,
KV heads, ``d_head``, ``seq_len`` n: the longest evaluation window, ``kv_bytes`` per element) and
``full_cache`` (2 · L · n_kv · d_head · n · bytes per sequence), where the effect orders came from
(``selection``) and which windows were used: ``selection_windows`` (the windows the stored streaming
effects were measured on, which chose the effect and beyond orders) and ``evaluation_windows``
(the others, on which every step is measured), window ids space-separated.
``streaming_curve_steps``: per curve, order and step, the KV heads streaming so far, the memory
saved (Σ 2 · d_head · max(0, n − S − W) · bytes over them, per sequence) and its share of the full
cache, the objective on the evaluation windows and its increase over the intact model, each with
its 95% interval, and the KV heads that start streaming at that step (``layer.kv_head``).

Revision ID: 0020_streaming_curves
Revises: 0019_streaming_effects
Create Date: 2026-12-06
"""

from alembic import op

revision = "0020_streaming_curves"
down_revision = "0019_streaming_effects"
branch_labels = None
depends_on = None

TABLES = [
    """
    CREATE TABLE streaming_curves (
        run_id INTEGER NOT NULL,
        curve_id INTEGER NOT NULL,
        created_at TIMESTAMP NOT NULL,
        sink INTEGER NOT NULL,              -- S
        recent INTEGER NOT NULL,            -- W
        objective VARCHAR NOT NULL,
        unit VARCHAR NOT NULL,
        orders VARCHAR NOT NULL,            -- comma-separated, as asked
        step DOUBLE NOT NULL,               -- share of the KV heads added per step
        seeds INTEGER NOT NULL,             -- random orders
        layers INTEGER NOT NULL,
        kv_heads INTEGER NOT NULL,          -- per layer
        d_head INTEGER NOT NULL,
        seq_len INTEGER NOT NULL,           -- n: the longest evaluation window's tokens
        kv_bytes INTEGER NOT NULL,          -- bytes per cached element
        full_cache DOUBLE NOT NULL,         -- bytes per sequence, every KV head full
        selection VARCHAR NOT NULL,         -- where the effect and beyond orders came from
        selection_windows VARCHAR NOT NULL, -- their window ids, space-separated ('' if none)
        evaluation_windows VARCHAR NOT NULL,-- the window ids every step is measured on
        evaluated INTEGER NOT NULL,         -- how many evaluation windows
        scheme VARCHAR NOT NULL,            -- replicate scheme of the intervals (SPEC §5d)
        groups INTEGER NOT NULL,
        intact DOUBLE NOT NULL,             -- the intact model's mean objective on them
        seconds DOUBLE NOT NULL,
        PRIMARY KEY (run_id, curve_id)
    )
    """,
    """
    CREATE TABLE streaming_curve_steps (
        run_id INTEGER NOT NULL,
        curve_id INTEGER NOT NULL,
        order_name VARCHAR NOT NULL,        -- effect, beyond, long_range, noise, layer, sinks, random:SEED
        step INTEGER NOT NULL,
        kv_heads_streaming INTEGER NOT NULL,
        fraction DOUBLE NOT NULL,           -- of the KV heads
        memory_saved DOUBLE NOT NULL,       -- bytes per sequence
        memory_share DOUBLE NOT NULL,       -- of the full cache
        objective DOUBLE, objective_lo DOUBLE, objective_hi DOUBLE,
        increase DOUBLE, increase_lo DOUBLE, increase_hi DOUBLE,
        streamed VARCHAR NOT NULL,          -- the KV heads streaming from this step: layer.kv_head, space-separated
        PRIMARY KEY (run_id, curve_id, order_name, step)
    )
    """,
]


def upgrade() -> None:
    for statement in TABLES:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TABLE IF EXISTS streaming_curve_steps")
    op.execute("DROP TABLE IF EXISTS streaming_curves")
