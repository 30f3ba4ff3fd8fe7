"""Initial schema: runs, documents, windows, batch ledger, per-head sums, histograms, anchors.

All statistics tables hold additive partial sums keyed by (run_id, batch_id); views sum them.
A batch is counted once: its ledger row and all its rows are written in one transaction, and
run_windows (primary key run_id, window_id) refuses a window counted twice.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

HEAD_SUM_COLUMNS = """
    high_pairs BIGINT NOT NULL,
    sim_sum_all DOUBLE NOT NULL,
    sim_sum_high DOUBLE NOT NULL,
    same_sentence_high BIGINT NOT NULL,
    same_token_high BIGINT NOT NULL,
    attended_high BIGINT NOT NULL,
    attn_to_cls DOUBLE NOT NULL,
    attn_to_sep DOUBLE NOT NULL,
    attn_to_punct DOUBLE NOT NULL,
    attn_to_self DOUBLE NOT NULL,
    attn_to_prev DOUBLE NOT NULL,
    attn_to_next DOUBLE NOT NULL,
    attn_entropy DOUBLE NOT NULL
"""

TABLES = [
    "CREATE SEQUENCE run_id_seq START 1",
    """
    CREATE TABLE runs (
        run_id INTEGER PRIMARY KEY DEFAULT nextval('run_id_seq'),
        run_key VARCHAR NOT NULL UNIQUE,
        name VARCHAR NOT NULL,
        corpus VARCHAR NOT NULL,
        corpus_fingerprint VARCHAR NOT NULL,
        model VARCHAR NOT NULL,
        model_name VARCHAR NOT NULL,
        n_layers INTEGER NOT NULL,
        n_heads INTEGER NOT NULL,
        d_head INTEGER NOT NULL,
        params JSON NOT NULL,
        seq_len INTEGER NOT NULL,
        short_range INTEGER NOT NULL,
        engine VARCHAR NOT NULL,
        device VARCHAR,
        status VARCHAR NOT NULL,
        created_at TIMESTAMP NOT NULL DEFAULT current_timestamp,
        started_at TIMESTAMP,
        finished_at TIMESTAMP,
        compute_s DOUBLE NOT NULL DEFAULT 0,
        wall_s DOUBLE NOT NULL DEFAULT 0,
        error VARCHAR
    )
    """,
    """
    CREATE TABLE documents (
        doc_id VARCHAR PRIMARY KEY,
        source VARCHAR NOT NULL,
        line INTEGER,
        n_chars INTEGER NOT NULL,
        preview VARCHAR
    )
    """,
    """
    CREATE TABLE windows (
        window_id VARCHAR PRIMARY KEY,
        doc_id VARCHAR NOT NULL,
        window_index INTEGER NOT NULL,
        n_tokens INTEGER NOT NULL
    )
    """,
    """
    CREATE TABLE batches (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        n_windows INTEGER NOT NULL,
        status VARCHAR NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0,
        error VARCHAR,
        compute_s DOUBLE,
        ingested_at TIMESTAMP,
        PRIMARY KEY (run_id, batch_id)
    )
    """,
    """
    CREATE TABLE run_windows (
        run_id INTEGER NOT NULL,
        window_id VARCHAR NOT NULL,
        batch_id INTEGER NOT NULL,
        PRIMARY KEY (run_id, window_id)
    )
    """,
    f"""
    CREATE TABLE head_stats (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        {HEAD_SUM_COLUMNS}
    )
    """,
    """
    CREATE TABLE run_chance (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        windows BIGINT NOT NULL,
        pairs BIGINT NOT NULL,
        same_sentence_pairs BIGINT NOT NULL,
        same_token_pairs BIGINT NOT NULL,
        attn_rows BIGINT NOT NULL
    )
    """,
    """
    CREATE TABLE dist_hist (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        distance SMALLINT NOT NULL,
        count BIGINT NOT NULL
    )
    """,
    """
    CREATE TABLE pair_hist (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        distance SMALLINT NOT NULL,
        count BIGINT NOT NULL
    )
    """,
    """
    CREATE TABLE anchors (
        run_id INTEGER NOT NULL,
        window_id VARCHAR NOT NULL,
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        token_id INTEGER NOT NULL,
        token VARCHAR NOT NULL,
        endpoint_count INTEGER NOT NULL,
        high_pairs INTEGER NOT NULL,
        anchor_share DOUBLE NOT NULL
    )
    """,
    # additive anchor summaries, so that queries on large runs need not scan `anchors`
    """
    CREATE TABLE anchor_tokens (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        layer SMALLINT NOT NULL,
        head SMALLINT NOT NULL,
        token_id INTEGER NOT NULL,
        token VARCHAR NOT NULL,
        windows BIGINT NOT NULL,
        share_sum DOUBLE NOT NULL
    )
    """,
    """
    CREATE TABLE anchor_layers (
        run_id INTEGER NOT NULL,
        batch_id INTEGER NOT NULL,
        layer SMALLINT NOT NULL,
        windows BIGINT NOT NULL,
        distinct_windows BIGINT NOT NULL,
        distinct_anchor_sum BIGINT NOT NULL,
        anchored_head_sum BIGINT NOT NULL
    )
    """,
]

VIEWS = [
    """
    CREATE VIEW chance_totals AS
    SELECT run_id, sum(windows) AS windows, sum(pairs) AS pairs,
           sum(same_sentence_pairs) AS same_sentence_pairs, sum(same_token_pairs) AS same_token_pairs,
           sum(attn_rows) AS attn_rows
    FROM run_chance GROUP BY run_id
    """,
    """
    CREATE VIEW pair_profile AS
    SELECT run_id, distance, sum(count) AS pairs FROM pair_hist GROUP BY run_id, distance
    """,
    """
    CREATE VIEW distance_totals AS
    SELECT run_id, layer, head, distance, sum(count) AS high_pairs
    FROM dist_hist GROUP BY run_id, layer, head, distance
    """,
    """
    CREATE VIEW head_totals AS
    SELECT s.run_id, s.layer, s.head,
           any_value(c.windows) AS windows, any_value(c.pairs) AS pairs,
           sum(s.high_pairs) AS high_pairs,
           sum(s.sim_sum_all) AS sim_sum_all, sum(s.sim_sum_high) AS sim_sum_high,
           sum(s.same_sentence_high) AS same_sentence_high,
           any_value(c.same_sentence_pairs) AS same_sentence_pairs,
           sum(s.same_token_high) AS same_token_high,
           any_value(c.same_token_pairs) AS same_token_pairs,
           sum(s.attended_high) AS attended_high,
           any_value(c.attn_rows) AS attn_rows,
           sum(s.attn_to_cls) AS attn_to_cls, sum(s.attn_to_sep) AS attn_to_sep,
           sum(s.attn_to_punct) AS attn_to_punct, sum(s.attn_to_self) AS attn_to_self,
           sum(s.attn_to_prev) AS attn_to_prev, sum(s.attn_to_next) AS attn_to_next,
           sum(s.attn_entropy) AS attn_entropy
    FROM head_stats s JOIN chance_totals c USING (run_id)
    GROUP BY s.run_id, s.layer, s.head
    """,
    """
    CREATE VIEW chance_distance AS
    SELECT p.run_id,
           sum(p.distance * p.pairs) / nullif(sum(p.pairs), 0) AS mean_distance_chance,
           sum(p.pairs) FILTER (WHERE p.distance <= r.short_range) / nullif(sum(p.pairs), 0)
               AS short_range_chance
    FROM pair_profile p JOIN runs r USING (run_id)
    GROUP BY p.run_id
    """,
    """
    CREATE VIEW head_distance AS
    SELECT d.run_id, d.layer, d.head,
           sum(d.distance * d.high_pairs) AS distance_sum,
           coalesce(sum(d.high_pairs) FILTER (WHERE d.distance <= r.short_range), 0) AS short_range_pairs
    FROM distance_totals d JOIN runs r USING (run_id)
    GROUP BY d.run_id, d.layer, d.head
    """,
    """
    CREATE VIEW head_metrics AS
    SELECT t.run_id, t.layer, t.head, t.windows, t.pairs, t.high_pairs,
           t.same_sentence_high / nullif(t.high_pairs, 0) AS within_sentence,
           t.same_sentence_pairs / nullif(t.pairs, 0) AS within_sentence_chance,
           within_sentence / nullif(within_sentence_chance, 0) AS within_sentence_lift,
           t.same_token_high / nullif(t.high_pairs, 0) AS repetition,
           t.same_token_pairs / nullif(t.pairs, 0) AS repetition_chance,
           repetition / nullif(repetition_chance, 0) AS repetition_lift,
           coalesce(d.distance_sum, 0) / nullif(t.high_pairs, 0) AS mean_distance,
           c.mean_distance_chance,
           coalesce(d.short_range_pairs, 0) / nullif(t.high_pairs, 0) AS short_range_share,
           c.short_range_chance,
           1 - t.attended_high / nullif(t.high_pairs, 0) AS noise_share,
           t.sim_sum_high / nullif(t.high_pairs, 0) AS sim_mean_high,
           t.sim_sum_all / nullif(t.pairs, 0) AS sim_mean_all,
           t.attn_to_cls / nullif(t.attn_rows, 0) AS attn_to_cls,
           t.attn_to_sep / nullif(t.attn_rows, 0) AS attn_to_sep,
           t.attn_to_punct / nullif(t.attn_rows, 0) AS attn_to_punct,
           t.attn_to_self / nullif(t.attn_rows, 0) AS attn_to_self,
           t.attn_to_prev / nullif(t.attn_rows, 0) AS attn_to_prev,
           t.attn_to_next / nullif(t.attn_rows, 0) AS attn_to_next,
           t.attn_entropy / nullif(t.attn_rows, 0) AS attn_entropy
    FROM head_totals t
    LEFT JOIN head_distance d USING (run_id, layer, head)
    LEFT JOIN chance_distance c USING (run_id)
    """,
    """
    CREATE VIEW anchor_counts AS
    SELECT a.run_id, a.layer, a.head, a.token_id, any_value(a.token) AS token, sum(a.windows) AS windows,
           sum(a.windows) / any_value(c.windows) AS window_share,
           sum(a.share_sum) / sum(a.windows) AS mean_anchor_share
    FROM anchor_tokens a JOIN chance_totals c USING (run_id)
    GROUP BY a.run_id, a.layer, a.head, a.token_id
    """,
    """
    CREATE VIEW anchor_distinctness AS
    SELECT run_id, layer,
           sum(distinct_windows) / nullif(sum(windows), 0) AS distinct_share,
           sum(distinct_anchor_sum) / nullif(sum(anchored_head_sum), 0) AS distinct_anchor_ratio,
           sum(windows) AS windows
    FROM anchor_layers GROUP BY run_id, layer
    """,
    """
    CREATE VIEW layer_metrics AS
    SELECT t.run_id, t.layer, count(*) AS heads,
           sum(t.same_sentence_high) / nullif(sum(t.high_pairs), 0) AS within_sentence,
           any_value(t.same_sentence_pairs) / nullif(any_value(t.pairs), 0) AS within_sentence_chance,
           within_sentence / nullif(within_sentence_chance, 0) AS within_sentence_lift,
           sum(t.same_token_high) / nullif(sum(t.high_pairs), 0) AS repetition,
           any_value(t.same_token_pairs) / nullif(any_value(t.pairs), 0) AS repetition_chance,
           sum(coalesce(d.distance_sum, 0)) / nullif(sum(t.high_pairs), 0) AS mean_distance,
           any_value(c.mean_distance_chance) AS mean_distance_chance,
           sum(coalesce(d.short_range_pairs, 0)) / nullif(sum(t.high_pairs), 0) AS short_range_share,
           1 - sum(t.attended_high) / nullif(sum(t.high_pairs), 0) AS noise_share,
           sum(t.attn_to_cls) / nullif(sum(t.attn_rows), 0) AS attn_to_cls,
           sum(t.attn_to_sep) / nullif(sum(t.attn_rows), 0) AS attn_to_sep,
           sum(t.attn_to_punct) / nullif(sum(t.attn_rows), 0) AS attn_to_punct,
           sum(t.attn_to_self) / nullif(sum(t.attn_rows), 0) AS attn_to_self,
           sum(t.attn_entropy) / nullif(sum(t.attn_rows), 0) AS attn_entropy
    FROM head_totals t
    LEFT JOIN head_distance d USING (run_id, layer, head)
    LEFT JOIN chance_distance c USING (run_id)
    GROUP BY t.run_id, t.layer
    """,
]


def upgrade() -> None:
    for statement in TABLES + VIEWS:
        op.execute(statement)


def downgrade() -> None:
    for view in (
        "layer_metrics",
        "anchor_distinctness",
        "anchor_counts",
        "head_metrics",
        "head_distance",
        "chance_distance",
        "head_totals",
        "distance_totals",
        "pair_profile",
        "chance_totals",
    ):
        op.execute(f"DROP VIEW IF EXISTS {view}")
    for table in (
        "anchor_layers",
        "anchor_tokens",
        "anchors",
        "pair_hist",
        "dist_hist",
        "run_chance",
        "head_stats",
        "run_windows",
        "batches",
        "windows",
        "documents",
        "runs",
    ):
        op.execute(f"DROP TABLE IF EXISTS {table}")
    op.execute("DROP SEQUENCE IF EXISTS run_id_seq")
