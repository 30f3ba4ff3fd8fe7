"""Top examples per head: the windows where each head's anchor, its most similar pair and its
strongest attention are strongest (service/measures/examples.py), with the text of those windows.

``head_examples``: per run, layer, head and kind (``anchor``, ``pair``, ``attention``) the best
``keep`` examples of each storing transaction (``batch_id`` its first batch, -1 once the run is
compacted: then the best ``keep`` of the run alone): ``score`` (what they are ranked by: the
anchor's endpoint count in H, ``C_ij``, ``A_ij · k_i``), ``value`` (``anchor_share``, ``C_ij``,
``A_ij``), the window and the token positions (``pos_i``: the anchor, i of the pair, the query;
``pos_j``: j, the key; NULL for an anchor) with their tokens' text.

``example_windows``: the tokens of every window an example is of (a JSON array of the tokenizer's
strings, pads left out), so that the text around an example is shown from the database alone.

``examples``: the view a reader asks, the best ``keep`` of every (run, layer, head, kind) ranked
(score descending, then window id, ``pos_i``, ``pos_j``: the reservoir's order), with the
window's document (source, line) and its index within it.

Revision ID: 0021_head_examples
Revises: 0020_streaming_curves
Create Date: 2026-12-06
"""

from alembic import op

revision = "0021_head_examples"
down_revision = "0020_streaming_curves"
branch_labels = None
depends_on = None

STATEMENTS = [
    """
    CREATE TABLE head_examples (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,      -- the storing transaction's first batch; -1 once compacted
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        kind VARCHAR NOT NULL,          -- anchor | pair | attention
        keep INTEGER NOT NULL,          -- k: examples the run keeps per (layer, head, kind)
        score DOUBLE NOT NULL,          -- the ranking: anchor endpoint count, C_ij, A_ij * k_i
        value DOUBLE NOT NULL,          -- anchor_share, C_ij, A_ij
        window_id VARCHAR NOT NULL,
        pos_i INTEGER NOT NULL,         -- the anchor's first position, i, the query (0-based, [CLS]/BOS = 0)
        pos_j INTEGER,                  -- j, the key; NULL for an anchor
        token_i VARCHAR NOT NULL,
        token_j VARCHAR
    )
    """,
    """
    CREATE TABLE example_windows (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        window_id VARCHAR NOT NULL,
        tokens VARCHAR NOT NULL         -- JSON array of the window's tokens as the tokenizer writes them
    )
    """,
    """
    CREATE VIEW examples AS
    WITH ranked AS (
        SELECT *, row_number() OVER (
            PARTITION BY run_id, layer, head, kind ORDER BY score DESC, window_id, pos_i, pos_j
        ) AS rank
        FROM head_examples
    )
    SELECT x.run_id, x.layer, x.head, x.kind, x.rank, x.score, x.value, x.window_id, x.pos_i, x.pos_j,
           x.token_i, x.token_j, d.source, d.line, w.window_index
    FROM ranked x
    LEFT JOIN (SELECT window_id, any_value(doc_id) AS doc_id, any_value(window_index) AS window_index
               FROM windows GROUP BY window_id) w USING (window_id)
    LEFT JOIN (SELECT doc_id, any_value(source) AS source, any_value(line) AS line
               FROM documents GROUP BY doc_id) d USING (doc_id)
    WHERE x.rank <= x.keep
    """,
]


def upgrade() -> None:
    for statement in STATEMENTS:
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS examples")
    op.execute("DROP TABLE IF EXISTS example_windows")
    op.execute("DROP TABLE IF EXISTS head_examples")
