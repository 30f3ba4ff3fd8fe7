"""Storage: schema, idempotent ingest, resume, and the views' arithmetic on a real DuckDB file."""

from __future__ import annotations

from pathlib import Path

import duckdb
import numpy as np
import pytest

from headatlas.service.engine.analysis import BatchResult, analyze_batch
from headatlas.service.engine.run_plan import iter_batches, survey_corpus
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.errors import StoreError
from headatlas.service.operations.embedded_run import analyze_corpus
from headatlas.service.params import AnalysisParams
from headatlas.service.storage import db
from headatlas.service.storage.store import Store


def counts(path) -> dict[str, int]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return {
            t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
            for t in ("runs", "batches", "run_windows", "head_stats", "dist_hist", "anchors", "run_chance")
        }
    finally:
        con.close()


@pytest.fixture()
def store(tmp_path):
    s = Store(tmp_path / "h.duckdb")
    s.ensure_schema()
    return s


# the parameters `analyze` runs small_corpus with: its 2 documents resolve `document` to block:8
# (SPEC §5d), which spreads the windows over several replicate groups
SMALL = AnalysisParams().resolved(2)


def _results(model, corpus, params=SMALL, batch_size=4):
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    return [
        analyze_batch(model, b, params, tokens, documents=d)
        for b, d, _ in iter_batches(str(corpus), model, params, tokens, batch_size=batch_size)
    ]


def _run(store, model, corpus, params=SMALL):
    summary = survey_corpus(str(corpus))
    from headatlas.service.engine.run_plan import run_key

    run, _ = store.find_or_create_run(
        run_key=run_key(summary.fingerprint, model, params),
        name="t",
        corpus=str(corpus),
        corpus_fingerprint=summary.fingerprint,
        model=model.describe(),
        params=params.to_dict(),
        engine="embedded",
        device="cpu",
    )
    return run


def test_batch_result_round_trips_through_bytes(tiny_model, small_corpus):
    result = _results(tiny_model, small_corpus)[0]
    back = BatchResult.from_bytes(result.to_bytes())
    assert back.window_ids == result.window_ids
    for key in result.heads:
        np.testing.assert_array_equal(back.heads[key], result.heads[key])
    np.testing.assert_array_equal(back.dist_hist, result.dist_hist)
    np.testing.assert_array_equal(back.anchor_token, result.anchor_token)
    assert back.chance == result.chance and back.vocab == result.vocab and back.windows == result.windows


def test_a_payloads_arrays_read_as_numpy_reads_them(tiny_model, small_corpus):
    """The payload's reader (its own header parse for plain arrays) gives what ``np.load`` gives:
    every member, dtype, shape, value, writable; and members of other kinds (object, Fortran
    order, a structured dtype, 0-d) through numpy's own reader."""
    import io

    from headatlas.service.engine.results import _npz, _unnpz

    blob = _results(tiny_model, small_corpus)[0].to_bytes()
    extra = {
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "pairs": np.array([(1, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
        "scalar": np.array(3.25),
        "empty": np.zeros((0, 4), dtype=np.int16),
        "text": np.array(["ab", "cde"]),
        "big_endian": np.arange(3, dtype=">i4"),
    }
    for payload in (blob, _npz(extra)):
        with np.load(io.BytesIO(payload), allow_pickle=False) as ref:
            read = _unnpz(payload)
            assert sorted(read) == sorted(ref.files)
            for name in ref.files:
                want, got = ref[name], read[name]
                assert got.dtype == want.dtype and got.shape == want.shape, name
                np.testing.assert_array_equal(got, want)
                assert got.flags.writeable, name


def test_a_payload_of_the_earlier_layout_reads_and_stores_its_measures_sums(tmp_path):
    """Before the measures' sums travelled by measure name, a payload held mixing's as
    ``mix.<method>.<sum>`` beside ``mixing_counts`` (windows, rows) and the averaged similarity
    matrices' as ``csm_bin``, ``csm_sum``, ``csm_count``. A writer newer than the worker reads
    them into ``measures`` and stores the rows the same sums in the new layout store."""
    import io

    import torch
    from sqlalchemy import text

    from headatlas.service.engine.results import MIX_SUMS, mixing_by_method, mixing_key
    from tests.test_baselines import SEQ, W1, W3, Z1, Z3, build_result, ids_in_distinct_groups, new_run, uniform_attn

    base = build_result(
        ids_in_distinct_groups(2),
        [W1, W3],
        torch.stack([Z1, Z3])[:, None, None],
        torch.stack([uniform_attn(8), uniform_attn(7)])[:, None, None],
    )
    assert base.measures == {}
    rng = np.random.default_rng(7)
    # one layer, one head: slots [head 0, the layer's whole (-1)]
    mixing = {
        method: {
            "head": np.array([0, -1]),
            **{k: rng.random((1, 2)) for k in MIX_SUMS},
            "dist": rng.random((1, 2, SEQ)) * (rng.random((1, 2, SEQ)) > 0.3),
        }
        for method in ("attention", "norm")
    }
    csm_sum = rng.random((3, 1, 1, 2, 2)).astype(np.float32)
    csm_count = rng.integers(0, 3, size=(3, 1, 1, 2, 2)).astype(np.int32)
    with np.load(io.BytesIO(base.to_bytes())) as data:
        arrays = {k: data[k] for k in data.files}
    arrays.update({f"mix.{m}.{k}": v for m, sums in mixing.items() for k, v in sums.items()})
    arrays.update(mixing_counts=np.array([2, 13]), csm_bin=np.array(4), csm_sum=csm_sum, csm_count=csm_count)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    old = BatchResult.from_bytes(buf.getvalue())

    assert old.measures.keys() == {"mixing", "csm"}
    assert int(old.measures["mixing"]["windows"]) == 2 and int(old.measures["mixing"]["rows"]) == 13
    by_method = mixing_by_method(old.measures["mixing"])
    assert by_method.keys() == mixing.keys()
    for method, sums in mixing.items():
        assert by_method[method].keys() == sums.keys()
        for key, value in sums.items():
            np.testing.assert_array_equal(by_method[method][key], value)
    csm = old.measures["csm"]
    assert int(csm["bin"]) == 4 and csm["sum"].dtype == np.float32 and csm["count"].dtype == np.int32
    np.testing.assert_array_equal(csm["sum"], csm_sum)
    np.testing.assert_array_equal(csm["count"], csm_count)

    new = BatchResult.from_bytes(base.to_bytes())
    new.measures = {
        "mixing": {
            "windows": np.array(2),
            "rows": np.array(13),
            **{mixing_key(m, k): v for m, sums in mixing.items() for k, v in sums.items()},
        },
        "csm": {"bin": np.array(4), "sum": csm_sum, "count": csm_count},
    }
    new = BatchResult.from_bytes(new.to_bytes())
    assert not any(k.startswith(("mix.", "csm_", "mixing_")) for k in np.load(io.BytesIO(new.to_bytes())).files)
    stored = []
    for name, res in (("old", old), ("new", new)):
        store = Store(tmp_path / f"{name}.duckdb")
        store.ensure_schema()
        run = new_run(store, name)
        store.ingest(run, [(0, res)])
        with store.read() as conn:
            stored.append(
                {
                    table: conn.execute(
                        text(f"SELECT * EXCLUDE (run_id, batch_id) FROM {table} ORDER BY ALL")
                    ).fetchall()
                    for table in ("mixing_stats", "mixing_dist", "csm_bins", "run_chance")
                }
            )
    assert stored[0] == stored[1]
    assert {(r.windows, r.rows) for r in stored[0]["mixing_stats"]} == {(2, 13)}
    assert len(stored[0]["mixing_stats"]) == 4 and len(stored[0]["csm_bins"]) == np.count_nonzero(csm_count)


def test_ingest_is_idempotent(store, tiny_model, small_corpus):
    run = _run(store, tiny_model, small_corpus)
    results = _results(tiny_model, small_corpus)
    assert store.ingest(run.run_id, [(0, results[0]), (1, results[1])]) == 2
    before = counts(store.path)
    assert store.ingest(run.run_id, [(0, results[0])]) == 0  # redelivered: skipped
    assert store.ingest(run.run_id, [(1, results[1]), (2, results[2])]) == 1  # only the new one
    after = counts(store.path)
    assert after["batches"] == before["batches"] + 1
    assert after["run_windows"] == before["run_windows"] + len(results[2].window_ids)


def test_a_window_counted_under_another_batch_id_is_refused_whole(store, tiny_model, small_corpus):
    run = _run(store, tiny_model, small_corpus)
    results = _results(tiny_model, small_corpus)
    store.ingest(run.run_id, [(0, results[0])])
    before = counts(store.path)
    with pytest.raises(StoreError, match="already counted"):
        store.ingest(run.run_id, [(5, results[0])])
    assert counts(store.path) == before  # nothing half-written


def test_views_derive_spec_measures_from_sums(store, tiny_model, small_corpus):
    run = _run(store, tiny_model, small_corpus)
    results = _results(tiny_model, small_corpus)
    store.ingest(run.run_id, list(enumerate(results)))
    heads = sum(r.heads["same_sentence_high"] for r in results)
    high = sum(r.heads["high_pairs"] for r in results)
    dist = sum(r.dist_hist for r in results)
    pairs = sum(r.chance["pairs"] for r in results)
    same_pairs = sum(r.chance["same_sentence_pairs"] for r in results)
    con = duckdb.connect(str(store.path), read_only=True)
    rows = con.execute(
        "SELECT layer, head, within_sentence, within_sentence_chance, mean_distance, short_range_share "
        "FROM head_metrics WHERE run_id = ? ORDER BY layer, head",
        [run.run_id],
    ).fetchall()
    con.close()
    assert len(rows) == tiny_model.n_layers * tiny_model.n_heads
    d = np.arange(dist.shape[2])
    for layer, head, within, chance, mean_d, short in rows:
        assert within == pytest.approx(heads[layer, head] / high[layer, head])
        assert chance == pytest.approx(same_pairs / pairs)
        assert mean_d == pytest.approx((dist[layer, head] * d).sum() / high[layer, head])
        assert short == pytest.approx(dist[layer, head, 1:5].sum() / high[layer, head])


def test_embedded_run_resumes_without_double_counting(tmp_path, tiny_model, small_corpus):
    store = Store(tmp_path / "r.duckdb")
    summary = survey_corpus(str(small_corpus))
    calls = {"n": 0}

    def stop_after_two(windows, consumed):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        analyze_corpus(
            str(small_corpus),
            store=store,
            model=tiny_model,
            params=AnalysisParams(),
            corpus=summary,
            batch_size=4,
            progress=stop_after_two,
        )
    partial = counts(store.path)
    assert store.get_run().status == "interrupted"
    assert 0 < partial["run_windows"]
    run = analyze_corpus(
        str(small_corpus), store=store, model=tiny_model, params=AnalysisParams(), corpus=summary, batch_size=4
    )
    assert run.status == "done"
    resumed = counts(store.path)
    # a fresh run in another database gives identical totals
    fresh_store = Store(tmp_path / "f.duckdb")
    analyze_corpus(
        str(small_corpus), store=fresh_store, model=tiny_model, params=AnalysisParams(), corpus=summary, batch_size=4
    )
    assert resumed["runs"] == 1
    assert resumed["run_windows"] == counts(fresh_store.path)["run_windows"]
    q = "SELECT layer, head, high_pairs, same_sentence_high, attended_high, round(sim_sum_all, 6) FROM head_totals ORDER BY 1, 2"
    a, b = duckdb.connect(str(store.path), read_only=True), duckdb.connect(str(fresh_store.path), read_only=True)
    assert a.execute(q).fetchall() == b.execute(q).fetchall()
    a.close(), b.close()


def test_stale_schema_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE alembic_version (version_num VARCHAR)")
    con.execute("INSERT INTO alembic_version VALUES ('0000')")
    con.close()
    with pytest.raises(StoreError, match="headatlas db upgrade"):
        Store(path).get_run()


def test_upgrade_is_repeatable(tmp_path):
    path = tmp_path / "u.duckdb"
    assert db.upgrade(path) == (None, db.head_revision())
    assert db.upgrade(path) == (db.head_revision(), db.head_revision())


def test_compaction_keeps_every_view_value_and_the_ledger(store, tiny_model, small_corpus):
    from headatlas.service.storage.compact import compact_run

    # blocks of one window: the small corpus's few documents still spread over several groups
    params = AnalysisParams(replicates="block:1")
    run = _run(store, tiny_model, small_corpus, params)
    results = _results(tiny_model, small_corpus, params)
    # a transaction per batch (one transaction's batches are summed when stored): compaction has rows to fold
    for batch_id, result in enumerate(results[:-1]):
        store.ingest(run.run_id, [(batch_id, result)])
    # the *_reps views hold the leave-one-group-out values the intervals are built from
    views = (
        "head_metrics",
        "layer_metrics",
        "distance_totals",
        "pair_profile",
        "head_metrics_reps",
        "layer_metrics_reps",
    )

    def snapshot():
        con = duckdb.connect(str(store.path), read_only=True)
        try:
            return {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall()) for v in views}
        finally:
            con.close()

    before = snapshot()
    with store.write() as conn:
        report = compact_run(conn, run.run_id)
    groups = len({int(g) for r in results[:-1] for g in r.reps})
    assert groups > 1
    # one row per replicate group, layer and head: the groups survive compaction
    assert report["head_stats"][1] == groups * tiny_model.n_layers * tiny_model.n_heads < report["head_stats"][0]
    after = snapshot()
    for view in views:
        assert len(after[view]) == len(before[view])
        for a, b in zip(after[view], before[view]):
            assert a == pytest.approx(b, rel=1e-12), view
    # the ledger still skips a redelivered batch; a new batch adds to the compacted sums
    assert store.ingest(run.run_id, [(0, results[0])]) == 0
    assert store.ingest(run.run_id, [(len(results) - 1, results[-1])]) == 1
    con = duckdb.connect(str(store.path), read_only=True)
    total = con.execute("SELECT sum(high_pairs) FROM head_stats").fetchone()[0]
    con.close()
    assert total == sum(int(r.heads["high_pairs"].sum()) for r in results)


def test_anchor_summaries_equal_the_per_window_anchor_rows(store, real_model, small_corpus):
    run = _run(store, real_model, small_corpus)
    store.ingest(run.run_id, list(enumerate(_results(real_model, small_corpus, batch_size=8))))
    con = duckdb.connect(str(store.path), read_only=True)
    try:
        direct = con.execute(
            "SELECT layer, head, token_id, count(*), avg(anchor_share) FROM anchors GROUP BY ALL ORDER BY ALL"
        ).fetchall()
        summary = con.execute(
            "SELECT layer, head, token_id, windows, mean_anchor_share FROM anchor_counts ORDER BY ALL"
        ).fetchall()
        assert len(direct) == len(summary) > 0
        for a, b in zip(direct, summary):
            assert a[:4] == b[:4] and a[4] == pytest.approx(b[4])
        direct = con.execute(
            "SELECT layer, avg(CASE WHEN n_distinct = n THEN 1.0 ELSE 0.0 END), sum(n_distinct) / sum(n) FROM ("
            " SELECT window_id, layer, count(*) AS n, count(DISTINCT token_id) AS n_distinct FROM anchors"
            " GROUP BY ALL) GROUP BY layer ORDER BY layer"
        ).fetchall()
        summary = con.execute(
            "SELECT layer, distinct_share, distinct_anchor_ratio FROM anchor_distinctness ORDER BY layer"
        ).fetchall()
        assert [d[0] for d in direct] == [s[0] for s in summary]
        for d, s in zip(direct, summary):
            assert d[1] == pytest.approx(s[1]) and d[2] == pytest.approx(s[2])
    finally:
        con.close()


def test_a_document_repeated_in_the_corpus_is_counted_once(tmp_path, tiny_model, small_corpus):
    text = small_corpus.read_text(encoding="utf-8").strip()
    first_doc = text.split("\n\n")[0]
    doubled = tmp_path / "doubled.txt"
    doubled.write_text(text + "\n\n" + first_doc + "\n", encoding="utf-8")
    summary = survey_corpus(str(doubled))
    assert summary.duplicates == 1
    once = analyze_corpus(
        str(small_corpus),
        store=Store(tmp_path / "a.duckdb"),
        model=tiny_model,
        params=AnalysisParams(),
        corpus=survey_corpus(str(small_corpus)),
        batch_size=4,
    )
    twice = analyze_corpus(
        str(doubled),
        store=Store(tmp_path / "b.duckdb"),
        model=tiny_model,
        params=AnalysisParams(),
        corpus=summary,
        batch_size=4,
    )
    assert once.status == twice.status == "done"
    assert counts(tmp_path / "a.duckdb")["run_windows"] == counts(tmp_path / "b.duckdb")["run_windows"]


def test_the_query_and_writer_paths_do_not_load_torch():
    """`headatlas runs|query|sql|status` and the writer import no torch: a query answers in a
    fraction of a second instead of waiting for the model stack to load."""
    import subprocess
    import sys

    code = (
        "import sys, headatlas.cli.main, headatlas.service.storage.store, headatlas.service.reports.queries, headatlas.workers.writer; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# Runs commands of the real CLI in turn in one fresh interpreter (as the console script would, one
# interpreter start instead of six) and reports after each whether torch or transformers was ever
# imported while it worked (not only at import time).
_NO_TORCH_RUNNER = """
import json, sys
from headatlas.cli.main import main
for args in json.loads(sys.argv[1]):
    sys.argv = ["headatlas", *args]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    loaded = sorted(m for m in ("torch", "transformers") if m in sys.modules)
    print("DONE", json.dumps({"args": args, "exit": code, "loaded": loaded}), file=sys.stderr, flush=True)
"""


def test_reading_commands_never_load_torch_while_they_work(tmp_path, tiny_model, small_corpus):
    """runs, sql, query heads|layers|distances (with intervals) and status on a real stored run:
    each answers without ever importing the model stack (one process runs them in turn, as
    the console script would, and names what it has imported after each)."""
    import json
    import subprocess
    import sys

    db = tmp_path / "r.duckdb"
    store = Store(db)
    store.ensure_schema()
    run = _run(store, tiny_model, small_corpus)
    store.ingest(run.run_id, list(enumerate(_results(tiny_model, small_corpus))))
    commands = [
        ["runs"],
        ["sql", "SELECT count(*) FROM head_metrics"],
        ["query", "heads", "--ci"],
        ["query", "layers", "--ci"],
        ["query", "distances", "--layer", "0", "--split", "attended"],
        ["status", "--broker", "redis://127.0.0.1:1/0"],  # no broker: what the database knows
    ]
    done = subprocess.run(
        [sys.executable, "-c", _NO_TORCH_RUNNER, json.dumps([[*args, "--db", str(db)] for args in commands])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[1],
    )
    assert done.returncode == 0, done.stderr
    reports = [json.loads(line[5:]) for line in done.stderr.splitlines() if line.startswith("DONE ")]
    assert [r["args"][: len(a)] for r, a in zip(reports, commands, strict=True)] == commands, done.stderr
    for report in reports:
        assert report["exit"] == 0 and report["loaded"] == [], (report, done.stderr[-500:])


def test_a_new_database_is_created_without_alembic_chatter(tmp_path, caplog):
    """A writer or beat logs at INFO and creates its database at start: alembic's ~20 INFO lines
    ("Running upgrade …") are kept to warnings unless headatlas logs at DEBUG."""
    import logging

    from headatlas.service.storage import db

    caplog.set_level(logging.INFO)
    db.upgrade(str(tmp_path / "quiet.duckdb"))
    assert not [r for r in caplog.records if r.name.startswith("alembic")]
    assert logging.getLogger("alembic").level == logging.NOTSET  # left as it was
    caplog.clear()
    logging.getLogger("headatlas").setLevel(logging.DEBUG)
    try:
        db.upgrade(str(tmp_path / "verbose.duckdb"))
    finally:
        logging.getLogger("headatlas").setLevel(logging.NOTSET)
    assert any(r.name.startswith("alembic") and "Running upgrade" in r.getMessage() for r in caplog.records)


def test_a_transactions_batches_are_summed_into_the_same_views_as_one_batch_at_a_time(
    tmp_path, tiny_model, small_corpus
):
    """Storing several batches in one transaction sums them per replicate group and key
    (batch_rows.py): fewer rows, and every view, window, anchor and ledger row as when each batch
    is stored on its own."""
    params = AnalysisParams(replicates="block:1")  # several replicate groups, some in several batches
    results = _results(tiny_model, small_corpus, params)
    assert len(results) >= 3
    stores = {}
    for name in ("apart", "together"):
        stores[name] = s = Store(tmp_path / f"{name}.duckdb")
        s.ensure_schema()
        run = _run(s, tiny_model, small_corpus, params)
        if name == "apart":
            assert sum(s.ingest(run.run_id, [(b, r)]) for b, r in enumerate(results)) == len(results)
        else:
            assert s.ingest(run.run_id, list(enumerate(results))) == len(results)

    def read(name: str) -> dict[str, list]:
        con = duckdb.connect(str(stores[name].path), read_only=True)
        try:
            views = [r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()]
            out = {v: sorted(con.execute(f"SELECT * FROM {v}").fetchall(), key=repr) for v in views}
            for table in ("anchors", "run_windows", "windows", "documents"):
                out[table] = sorted(con.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
            out["batches"] = con.execute("SELECT batch_id, n_windows, status FROM batches ORDER BY 1").fetchall()
            out["rows"] = [con.execute("SELECT count(*) FROM head_stats").fetchone()[0]]
            return out
        finally:
            con.close()

    apart, together = read("apart"), read("together")
    assert together.pop("rows")[0] < apart.pop("rows")[0]
    assert apart.keys() == together.keys() and len(apart) > 10
    for name, rows in apart.items():
        assert len(together[name]) == len(rows), name
        for a, b in zip(rows, together[name]):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                if isinstance(x, float) and isinstance(y, float):
                    assert y == pytest.approx(x, rel=1e-12, abs=1e-12, nan_ok=True), name
                else:
                    assert x == y, name


def test_a_files_storing_transaction_does_not_try_fsst_on_its_strings(tmp_path, tiny_model, small_corpus):
    """DuckDB tries FSST on every string segment it writes, and the anchors' strings (window ids
    and tokens, repeated per head) always end up in a dictionary: a file's storing transaction
    does not try it (ingest.NOT_TRIED; 6–9 % of storing's CPU, docs/benchmarks.md). The window ids,
    distinct hex that FSST would take, are stored plain, and read back the same."""
    import copy

    first = _results(tiny_model, small_corpus)[0]
    items = []
    # 6,000 distinct window ids: DuckDB takes FSST for them from about 5,000 (2,000 stay plain)
    for b in range(-(-6000 // len(first.window_ids))):
        res = copy.copy(first)
        res.window_ids = [f"{b:06d}{w[6:]}" for w in first.window_ids]
        res.windows = [dict(w, window_id=i) for w, i in zip(first.windows, res.window_ids)]
        items.append((b, res))
    s = Store(tmp_path / "h.duckdb")
    s.ensure_schema()
    run = _run(s, tiny_model, small_corpus)
    assert s.ingest(run.run_id, items) == len(items)
    con = duckdb.connect(str(s.path), read_only=True)
    try:
        tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        compressed = {
            (t, column)
            for t in tables
            for column, how in con.execute(
                f"SELECT column_name, compression FROM pragma_storage_info('{t}')"
            ).fetchall()
            if how == "FSST"
        }
        stored = sorted(r[0] for r in con.execute("SELECT window_id FROM run_windows").fetchall())
        anchored = con.execute("SELECT count(DISTINCT window_id) FROM anchors").fetchone()[0]
    finally:
        con.close()
    assert compressed == set()
    assert stored == sorted(w for _b, res in items for w in res.window_ids)
    assert anchored > 0
