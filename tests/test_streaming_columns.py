"""Streaming effects where heads are read (SPEC §10): `query heads` columns with their intervals
and sort, the SQL view ``streaming_metrics``, the atlas, a head's page, the Python API and
`headatlas metrics`.

Known answers: a random Llama run (4 query heads on 2 KV heads, grouped-query attention) is
analysed once; its streaming sums are written here, per replicate group, for two restrictions,
and every front end must show the mean and the delete-one-group jackknife interval (SPEC §5d)
computed by hand from them, each query head with its KV head's value (h // 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from headatlas.service.errors import ParameterError

T95 = {2: 4.302652729911275, 3: 3.182446305284263}  # t_{df, 0.975}
SHOWN, OTHER = (1, 4), (0, 16)  # the fewest recent keys is the restriction the head tables show


@pytest.fixture(scope="module")
def gqa_run(tmp_path_factory, demo_corpus):
    """A finished random:llama run (4 heads, 2 KV heads) with hand-made streaming sums of two
    restrictions: (database, run id, {restriction: (groups, sums)})."""
    from conftest import invoke_cli

    from headatlas.service.storage.store import Store
    from headatlas.service.storage.streaming_rows import SUMS, StreamingSums, store_streaming

    folder = tmp_path_factory.mktemp("streaming_columns")
    corpus = folder / "corpus.txt"
    docs = [d.strip() for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()][:2]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    db = str(folder / "gqa.duckdb")
    args = ["--seq-len", "32", "--sentences", "punct", "--replicates", "window", "--name", "gqa"]
    done = invoke_cli("analyze", str(corpus), "--model", "random:llama", *args, "--db", db)
    assert done.returncode == 0, done.stderr
    store = Store(db)
    run = store.get_run("gqa")
    with store.checked_read() as conn:
        from sqlalchemy import text

        held = [
            int(r[0])
            for r in conn.execute(text("SELECT rep FROM run_reps WHERE run_id = :r ORDER BY rep"), {"r": run.run_id})
        ]
    g = np.random.default_rng(3)
    made = {}
    for (sink, recent), groups in ((SHOWN, held[:3]), (OTHER, held[1:5])):
        shape = (len(groups), 2, 2)  # [group, layer, kv_head]
        windows = np.broadcast_to(g.integers(1, 4, len(groups))[:, None, None], shape).astype(float)
        sums = {name: np.zeros(shape) for name in SUMS}
        sums.update(
            windows=windows.copy(),
            tokens=32.0 * windows,
            effect_sum=windows * g.normal(0.01, 0.02, shape),
            beyond_sum=windows * g.uniform(0.2, 0.9, shape),
            objective_sum=10.0 * windows,
        )
        restriction = StreamingSums(sink, recent, "next_token_loss", 32, np.array(groups), sums)
        store.atomically(lambda conn, s=restriction: store_streaming(conn, run.run_id, s))
        made[(sink, recent)] = (groups, sums)
    return db, run.run_id, made


def by_hand(sums: dict, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over the groups of ``name`` per window ``[layer, kv_head]`` and its jackknife bounds."""
    total, counts = sums[name], sums["windows"]
    mean = total.sum(0) / counts.sum(0)
    r = len(total)
    drops = np.stack([(total.sum(0) - total[k]) / (counts.sum(0) - counts[k]) for k in range(r)])
    half = T95[r - 1] * np.sqrt((r - 1) / r * ((drops - drops.mean(0)) ** 2).sum(0))
    return mean, mean - half, mean + half


def heads_json(cli, db: str, *args: str) -> list[dict]:
    done = cli("query", "heads", "--run", "gqa", "--db", db, "--format", "json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_query_heads_shows_each_query_heads_kv_head_with_its_interval(gqa_run, cli) -> None:
    db, _run_id, made = gqa_run
    _groups, sums = made[SHOWN]
    effect, lo, hi = by_hand(sums, "effect_sum")
    beyond, blo, bhi = by_hand(sums, "beyond_sum")
    rows = heads_json(cli, db, "--ci")
    assert len(rows) == 8
    for row in rows:
        layer, kv = row["layer"], row["head"] // 2  # grouped-query: heads 0, 1 read KV head 0; 2, 3 KV head 1
        assert row["effect_streaming"] == pytest.approx(effect[layer, kv], rel=1e-12)
        assert (row["effect_streaming_lo"], row["effect_streaming_hi"]) == pytest.approx((lo[layer, kv], hi[layer, kv]))
        assert row["streaming_beyond"] == pytest.approx(beyond[layer, kv], rel=1e-12)
        assert (row["streaming_beyond_lo"], row["streaming_beyond_hi"]) == pytest.approx(
            (max(0.0, blo[layer, kv]), min(1.0, bhi[layer, kv]))
        )
        assert (row["streaming_sink"], row["streaming_recent"]) == SHOWN
    assert rows[0]["effect_streaming"] == rows[1]["effect_streaming"] != rows[2]["effect_streaming"]
    # sorted by it, largest first and smallest first; the table names the restriction and the rule
    ranked = heads_json(cli, db, "--sort", "effect_streaming")
    values = [r["effect_streaming"] for r in ranked]
    assert values == sorted(values, reverse=True)
    ranked = heads_json(cli, db, "--sort", "effect_streaming", "--asc", "--top", "2")
    assert [r["effect_streaming"] for r in ranked] == sorted(values)[:2]
    table = cli("query", "heads", "--run", "gqa", "--db", db, "--ci")
    assert table.returncode == 0 and "effect_streaming" in table.stdout
    said = " ".join(table.stdout.split())
    assert "S = 1 sinks and W = 4 recent keys" in said and "also stored: S = 0, W = 16" in said


def test_the_sql_view_holds_every_restriction_with_its_interval(gqa_run, cli) -> None:
    db, run_id, made = gqa_run
    done = cli("sql", "--db", db, "--format", "json", "SELECT * FROM streaming_metrics ORDER BY recent, layer, kv_head")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert len(rows) == 8 and {(r["sink"], r["recent"]) for r in rows} == {SHOWN, OTHER}
    for row in rows:
        groups, sums = made[(row["sink"], row["recent"])]
        layer, kv = row["layer"], row["kv_head"]
        effect, lo, hi = by_hand(sums, "effect_sum")
        beyond, blo, bhi = by_hand(sums, "beyond_sum")
        assert row["run_id"] == run_id and row["groups"] == len(groups)
        assert row["windows"] == sums["windows"][:, layer, kv].sum()
        assert (row["effect"], row["effect_lo"], row["effect_hi"]) == pytest.approx(
            (effect[layer, kv], lo[layer, kv], hi[layer, kv])
        )
        assert (row["beyond"], row["beyond_lo"], row["beyond_hi"]) == pytest.approx(
            (beyond[layer, kv], max(0.0, blo[layer, kv]), min(1.0, bhi[layer, kv]))
        )
        assert row["objective"] == "next_token_loss" and row["objective_mean"] == pytest.approx(10.0)
        assert row["shown"] == ((row["sink"], row["recent"]) == SHOWN)
    assert "streaming_metrics" in " ".join(cli("sql", "--help").stdout.split())


def test_the_atlas_the_head_page_the_api_and_metrics_show_it(gqa_run, cli, tmp_path) -> None:
    import re

    from web_support import Client

    import headatlas
    from headatlas.service.web.app import WebApp

    db, run_id, made = gqa_run
    effect, lo, hi = by_hand(made[SHOWN][1], "effect_sum")
    # the Python API: the same column as `query heads`
    heads = headatlas.connect(db).run("gqa").heads(ci=True)
    got = heads.arrow.column("effect_streaming").to_pylist()
    assert got == pytest.approx([effect[layer, head // 2] for layer in range(2) for head in range(4)], rel=1e-12)
    # a head's page: its value, interval and (S, W); the run page offers it as the atlas' colour
    client = Client(WebApp(db))
    page = client.get(f"/runs/{run_id}/heads/1/3")
    assert page.status == 200
    text = re.sub(r"<[^>]+>", " ", page.text)
    assert "effect_streaming" in text and "S = 1 sinks and W = 4 recent keys" in text
    mine = client.get(f"/runs/{run_id}/heads/1/3.json").json()["metrics"][0]
    assert (mine["effect_streaming_lo"], mine["effect_streaming_hi"]) == pytest.approx((lo[1, 1], hi[1, 1]))
    atlas = client.get(f"/runs/{run_id}", {"color": "effect_streaming"})
    assert atlas.status == 200 and '<option value="effect_streaming" selected>' in atlas.text
    out = tmp_path / "atlas.png"
    drawn = cli("plot", "atlas", "--run", "gqa", "--db", db, "--colour", "effect_streaming", "--out", str(out))
    assert drawn.returncode == 0 and out.stat().st_size > 0, drawn.stderr
    listed = cli("metrics", "--format", "json")
    assert listed.returncode == 0
    named = {r["column"]: r for r in json.loads(listed.stdout)}
    assert {"effect_streaming", "streaming_beyond", "streaming_sink", "streaming_recent"} <= set(named)
    assert named["effect_streaming"]["spec"] == "§10"


def test_a_tighter_restriction_stored_later_is_shown_at_once(gqa_run, cli) -> None:
    """The run's stored results are keyed by its streaming effects too: a restriction measured
    after them is not hidden behind results stored before it."""
    from headatlas.service.reports.stored import refresh
    from headatlas.service.storage.store import Store
    from headatlas.service.storage.streaming_rows import StreamingSums, store_streaming

    db, run_id, made = gqa_run
    store = Store(db)
    refresh(store, run_id)
    groups, sums = made[SHOWN]
    tighter = StreamingSums(1, 2, "next_token_loss", 32, np.array(groups), {k: 2 * v for k, v in sums.items()})
    try:
        store.atomically(lambda conn: store_streaming(conn, run_id, tighter))
        rows = heads_json(cli, db, "--ci")
        assert {(r["streaming_sink"], r["streaming_recent"]) for r in rows} == {(1, 2)}
        effect, _lo, _hi = by_hand(tighter.sums, "effect_sum")
        assert rows[5]["effect_streaming"] == pytest.approx(effect[1, 0])
    finally:
        from sqlalchemy import text

        store.atomically(lambda conn: conn.execute(text("DELETE FROM streaming_effects WHERE recent = 2")))
    assert {(r["streaming_sink"], r["streaming_recent"]) for r in heads_json(cli, db)} == {SHOWN}


def test_a_name_that_is_not_a_column_is_refused(gqa_run) -> None:
    from headatlas.service.reports import queries
    from headatlas.service.storage.store import Store

    db, run_id, _made = gqa_run
    with Store(db).checked_read() as conn:
        with pytest.raises(ParameterError, match="not a metric of the heads"):
            queries.heads(conn, run_id, sort="effect_streamed")


def test_streaming_effects_measured_reach_the_head_table(gqa_run, cli) -> None:
    """`effects RUN --streaming` measured on the run: each query head's column in `query heads` is
    its KV head's row of the effects table, at once (the run's stored results stored again)."""
    from sqlalchemy import text

    from headatlas.service.storage.store import Store

    db, _run_id, _made = gqa_run
    try:
        done = cli(
            "effects", "gqa", "--streaming", "--sink", "1", "--recent", "3", "--windows", "2", "--db", db,
            "--format", "json",
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        table = {(r["layer"], r["kv_head"]): r for r in json.loads(done.stdout)}
        rows = heads_json(cli, db, "--ci")
        for row in rows:
            want = table[(row["layer"], row["head"] // 2)]
            assert (row["streaming_sink"], row["streaming_recent"]) == (1, 3)
            assert row["effect_streaming"] == pytest.approx(want["effect"], rel=1e-9, abs=1e-12)
            assert row["streaming_beyond"] == pytest.approx(want["beyond"], rel=1e-9)
    finally:
        Store(db).atomically(lambda conn: conn.execute(text("DELETE FROM streaming_effects WHERE recent = 3")))


def test_views_older_than_the_columns_refuse_them_until_db_upgrade(gqa_run, cli, tmp_path) -> None:
    """A database at the head schema whose views were built before the streaming columns (no
    migration adds them): `query heads` still answers, and sorting by a column its views lack is
    refused naming `headatlas db upgrade`, after which it is there."""
    import shutil

    import duckdb

    db = str(tmp_path / "old_views.duckdb")
    shutil.copy(gqa_run[0], db)
    with duckdb.connect(db) as conn:
        conn.execute("DROP VIEW head_metrics")
        conn.execute(
            "CREATE VIEW head_metrics AS SELECT * EXCLUDE (drop_rep, effect_streaming, streaming_beyond, "
            "streaming_sink, streaming_recent) FROM head_metrics_reps WHERE drop_rep = -1"
        )
    assert cli("query", "heads", "--run", "gqa", "--db", db).returncode == 0
    refused = cli("query", "heads", "--run", "gqa", "--db", db, "--sort", "effect_streaming")
    assert refused.returncode == 2 and "effect_streaming" in refused.stderr and "db upgrade" in refused.stderr
    assert cli("db", "upgrade", "--db", db).returncode == 0
    assert {r["streaming_recent"] for r in heads_json(cli, db, "--sort", "effect_streaming")} == {SHOWN[1]}


# the view the readers read through before (``anchor_counts``, which joins the replicated chain):
# they now sum the one run's anchors themselves (``queries.ANCHOR_COUNTS_SQL``)
VIEW_TOP_ANCHORS = """
    WITH ranked AS (
        SELECT layer, head, token, window_share,
               row_number() OVER (PARTITION BY layer, head ORDER BY windows DESC, token) AS rank
        FROM anchor_counts WHERE run_id = :run
    )
    SELECT layer, head, string_agg(token || ' ' || printf('%.0f%%', 100 * window_share), ', ' ORDER BY rank)
    FROM ranked WHERE rank <= :n GROUP BY layer, head
"""


def test_the_restriction_shown_and_the_top_anchors_are_the_views(gqa_run) -> None:
    """What the readers read from the tables for one run equals what the views say: the restriction
    the head tables show (``streaming_metrics.shown``), each head's top anchors and whether they
    are byte-level strings (``anchor_counts``)."""
    from sqlalchemy import text

    from headatlas.service.reports.queries import anchors_as_text, byte_level_run, top_anchors
    from headatlas.service.storage.store import Store
    from headatlas.service.storage.streaming_rows import shown_restriction

    db, run_id, _made = gqa_run
    with Store(db).checked_read() as conn:
        view = conn.execute(
            text("SELECT DISTINCT sink, recent FROM streaming_metrics WHERE run_id = :r AND shown"), {"r": run_id}
        ).all()
        assert [tuple(r) for r in view] == [SHOWN] and shown_restriction(conn, run_id) == SHOWN
        assert shown_restriction(conn, run_id + 1) is None
        byte_level = conn.execute(
            text("SELECT 1 FROM anchor_counts WHERE run_id = :r AND (token LIKE 'Ġ%' OR token = 'Ċ') LIMIT 1"),
            {"r": run_id},
        ).first()
        assert byte_level_run(conn, run_id) == (byte_level is not None)
        for n in (1, 3, 10):
            rows = conn.execute(text(VIEW_TOP_ANCHORS), {"run": run_id, "n": n}).all()
            want = {(r[0], r[1]): anchors_as_text(r[2]) for r in rows}
            assert len(want) == 8 and top_anchors(conn, run_id, n) == want, n
        assert top_anchors(conn, run_id + 1, 3) == {}
