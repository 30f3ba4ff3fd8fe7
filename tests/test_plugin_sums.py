"""A plugin's own per-head sums and the columns over them, end to end: stored by name from the batch
results (table ``named_head_sums``), summed over batches and replicate groups as ``head_stats``' own
are, read by the views as a column of their name, and shown by `query heads` (--sort, --columns,
--ci), the Python API, the web page and `headatlas metrics`.

The worked example is the test plugins' ``both_punct`` metric (tests/plugins/…/punct.py): the share
of the high-similarity pairs whose two tokens are both punctuation, from its sum
``"punct_pairs.both_punct"``, which the plugin's measure ``punct_pairs`` (punct_measure.py)
computes in the batch. Its first tests store real batch results of the tiny model whose plugin sum
is a known function of each head's ``high_pairs``, so every column over it has a known answer; the
last runs the measure itself through the embedded analysis, on text whose answer is known (all
punctuation: 1; none: 0)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from web_support import Client

from headatlas.service.engine.results import BatchResult
from headatlas.service.storage.named_sums import read as named_sums_of
from headatlas.service.storage.store import Store
from tests.test_store import _results, _run

SUM = "punct_pairs.both_punct"
QUOTED = f'"{SUM}"'  # its name in SQL


def _with_sum(result: BatchResult, *, extra: bool = True) -> BatchResult:
    """``result`` with the plugin's sum: per group and head, ``high_pairs · (k + 1) // (L·H + 1)``
    (k the head's index), a count ≤ high_pairs that differs between heads; ``extra``: also a sum no
    metric declares (stored and readable by name, no view column)."""
    high = result.rep_heads["high_pairs"]
    n_layers, n_heads = high.shape[1:]
    rank = np.arange(n_layers * n_heads).reshape(n_layers, n_heads) + 1
    result.rep_heads[SUM] = (high * rank) // (n_layers * n_heads + 1)
    if extra:
        result.rep_heads["other.weight"] = high * 0.5
    return result


@pytest.fixture(scope="module")
def summed(tmp_path_factory, tiny_model, demo_corpus):
    """A finished run whose batches carry the plugin's sum, stored in two transactions (two groups
    of summed rows), with its results stored as a finished run's are; and the expected sums
    ``[layer, head]``."""
    from headatlas.service.reports import stored

    folder = tmp_path_factory.mktemp("plugin-sums")
    corpus = folder / "small.txt"
    docs = demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]
    corpus.write_text("\n\n".join(d.strip() for d in docs) + "\n", encoding="utf-8")
    store = Store(folder / "p.duckdb")
    store.ensure_schema()
    run = _run(store, tiny_model, corpus)
    results = [_with_sum(r) for r in _results(tiny_model, corpus)]
    assert len(results) >= 3
    assert store.ingest(run.run_id, [(0, results[0]), (1, results[1])]) == 2
    assert store.ingest(run.run_id, list(enumerate(results))[2:]) == len(results) - 2
    store.set_status(run.run_id, "done", finished=True)
    assert stored.refresh(store, run.run_id)
    both = sum(r.rep_heads[SUM].sum(0) for r in results)
    high = sum(r.rep_heads["high_pairs"].sum(0) for r in results)
    other = sum(r.rep_heads["other.weight"].sum(0) for r in results)
    return store, run, both, high, other


def _view(store, sql: str) -> list[tuple]:
    with store.read() as conn:
        return [tuple(r) for r in conn.exec_driver_sql(sql).fetchall()]


@pytest.fixture()
def one_result(tiny_model, small_corpus):
    return _results(tiny_model, small_corpus)[0]


def test_a_payloads_named_sum_travels_and_real_results_store_none_by_name(one_result):
    """The payload keeps a ``<measure>.<sum>`` head sum; headatlas's own sums all have columns."""
    from headatlas.service.storage.batch_rows import batch_tables

    result = one_result
    assert "named_head_sums" not in batch_tables(1, [(0, result)])  # every built-in sum is a column
    back = BatchResult.from_bytes(_with_sum(result).to_bytes())
    np.testing.assert_array_equal(back.rep_heads[SUM], result.rep_heads[SUM])
    assert batch_tables(1, [(0, back)])["named_head_sums"].num_rows == 2 * result.rep_heads[SUM].size


def test_named_sums_are_summed_over_batches_and_read_per_run_and_by_the_views(summed):
    from headatlas.service.storage import named_sums

    store, run, both, high, other = summed
    with store.read() as conn:
        columns, rows = named_sums.read(conn, run.run_id)
    assert columns == ["layer", "head", "name", "value"]
    got = {(name, layer, head): value for layer, head, name, value in rows}
    n_layers, n_heads = both.shape
    assert len(got) == 2 * n_layers * n_heads
    for (layer, head), value in np.ndenumerate(both):
        assert got[(SUM, layer, head)] == value
        assert got[("other.weight", layer, head)] == pytest.approx(other[layer, head])
    view = _view(
        store,
        f"SELECT layer, head, {QUOTED}, both_punct_share, word_pairs_share, both_punct_per_window, head_metrics.windows "
        f"FROM head_totals JOIN head_metrics USING (run_id, layer, head) WHERE run_id = {run.run_id}",
    )
    assert len(view) == n_layers * n_heads
    for layer, head, total, share, words, per_window, windows in view:
        assert total == both[layer, head]
        assert share == pytest.approx(both[layer, head] / high[layer, head], abs=1e-12)
        assert words == pytest.approx(1 - share, abs=1e-12)
        assert per_window == pytest.approx(both[layer, head] / windows, abs=1e-12)
    # a sum nobody declares has no column; the layer view sums the heads' as it sums high_pairs
    assert "other.weight" not in {r[0] for r in _view(store, "DESCRIBE head_totals")}
    layers = dict(_view(store, f"SELECT layer, both_punct_share FROM layer_metrics WHERE run_id = {run.run_id}"))
    for layer in range(n_layers):
        assert layers[layer] == pytest.approx(both[layer].sum() / high[layer].sum(), abs=1e-12)


def test_compaction_folds_named_sums_and_the_views_read_the_same(summed, tmp_path):
    import shutil

    store, run, both, high, _ = summed
    copy = tmp_path / "copy.duckdb"
    shutil.copy(store.path, copy)
    other = Store(copy)
    query = f"SELECT layer, head, both_punct_share FROM head_metrics WHERE run_id = {run.run_id} ORDER BY ALL"
    before = _view(other, query)
    [(groups,)] = _view(other, f"SELECT count(DISTINCT rep) FROM named_head_sums WHERE run_id = {run.run_id}")
    report = other.compact(run.run_id)
    rows_before, rows_after = report["named_head_sums"]
    assert rows_after == 2 * both.size * groups <= rows_before  # one row per group, head and name
    assert _view(other, query) == pytest.approx(before)


def test_a_batch_stored_without_the_sum_leaves_the_runs_sum_null_not_partial(tmp_path, tiny_model, small_corpus, cli):
    store = Store(tmp_path / "strict.duckdb")
    store.ensure_schema()
    run = _run(store, tiny_model, small_corpus)
    first, second, *_ = _results(tiny_model, small_corpus)
    store.ingest(run.run_id, [(0, _with_sum(first))])
    store.ingest(run.run_id, [(1, second)])  # a batch of a measure that did not run
    values = _view(store, f"SELECT both_punct_share, noise_share FROM head_metrics WHERE run_id = {run.run_id}")
    assert values and all(share is None for share, _ in values) and any(n is not None for _, n in values)
    # sorted by, it would print blank in layer order: refused, saying why
    refused = cli("query", "heads", "--db", str(store.path), "--sort", "both_punct_share")
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert f"--sort both_punct_share: run {run.run_id} holds no value of it" in refused.stderr
    assert f"its sums ({SUM}) were not stored" in refused.stderr
    # nor is it a blank column of the web page's head table (--wide still shows it)
    from headatlas.service.web.app import WebApp

    client = Client(WebApp(str(store.path)))
    table = client.get(f"/runs/{run.run_id}").text.split('id="heads-table"', 1)[1]
    wide = client.get(f"/runs/{run.run_id}?wide=1").text.split('id="heads-table"', 1)[1]
    assert "both_punct_share" not in table and "both_punct_share" in wide.replace("<wbr>", "")


def test_query_heads_sorts_shows_and_bounds_a_plugin_column(summed, cli):
    store, run, both, high, _ = summed
    share = both / np.maximum(high, 1)
    order = sorted(np.ndindex(share.shape), key=lambda k: (-share[k], k))
    db = str(store.path)
    table = cli("query", "heads", "--db", db, "--sort", "both_punct_share", "--top", "3")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header = next(line for line in lines if line.startswith("layer"))
    assert header.split()[:3] == ["layer", "head", "both_punct_share"]  # the sort column, third
    as_json = cli("query", "heads", "--db", db, "--sort", "both_punct_share", "--ci", "--format", "json")
    rows = json.loads(as_json.stdout)
    assert [(r["layer"], r["head"]) for r in rows] == order
    for r in rows:
        assert r["both_punct_share"] == pytest.approx(share[r["layer"], r["head"]], abs=1e-12)
        assert 0 <= r["both_punct_share_lo"] <= r["both_punct_share"] <= r["both_punct_share_hi"] <= 1
        assert "word_pairs_share_lo" in r  # a column over its own earlier column has its interval
        assert "both_punct_per_window" in r and "both_punct_per_window_lo" not in r  # declared without
    ascending = cli("query", "heads", "--db", db, "--sort", "word_pairs_share", "--asc", "--format", "json")
    assert [(r["layer"], r["head"]) for r in json.loads(ascending.stdout)] == order
    picked = cli("query", "heads", "--db", db, "--columns", "both_punct_share,word_pairs_share", "--format", "csv")
    assert picked.returncode == 0 and picked.stdout.splitlines()[0] == "both_punct_share,word_pairs_share"


@pytest.mark.filterwarnings("ignore::headatlas.service.api.IntervalWarning")  # a short run, on purpose
def test_the_python_api_and_the_web_page_have_the_plugin_column(summed):
    import headatlas
    from headatlas.service.web.app import WebApp

    store, run, both, high, _ = summed
    share = both / np.maximum(high, 1)
    best = np.unravel_index(np.argmax(share), share.shape)
    heads = headatlas.connect(store.path).run(run.run_id).heads(sort="both_punct_share", top=2, ci=True).to_pylist()
    assert (heads[0]["layer"], heads[0]["head"]) == best and "both_punct_share_lo" in heads[0]
    client = Client(WebApp(str(store.path)))
    page = client.get(f"/runs/{run.run_id}.json?sort=both_punct_share").json()
    assert (page["heads"][0]["layer"], page["heads"][0]["head"]) == best
    assert page["heads"][0]["both_punct_share"] == pytest.approx(share[best], abs=1e-12)
    html = client.get(f"/runs/{run.run_id}?sort=both_punct_share").text
    table = html[html.index('id="heads-table"') :]
    # a column of the default head table (declared shown=PAGE), sortable from its header
    assert "sort=both_punct_share&amp;asc=1#heads" in table and "both_punct_share ▼" in table.replace("<wbr>", "")


def test_headatlas_metrics_lists_the_plugin_columns_and_their_sum(cli):
    listed = {r["column"]: r for r in json.loads(cli("metrics", "--format", "json").stdout)}
    for column in ("both_punct_share", "word_pairs_share", "both_punct_per_window"):
        assert listed[column]["metric"] == "both_punct" and listed[column]["sums"] == SUM
        assert listed[column]["origin"].startswith("plugin both_punct (headatlas-test-plugins")
    assert listed["noise_share"]["sums"] == "attended_high"


@pytest.mark.parametrize(
    ("text", "share"), [(". , . , " * 60, 1.0), ("the cat sat on the mat and the dog ran " * 12, 0.0)]
)
def test_the_plugin_measure_computes_the_sum_in_the_batch_and_query_heads_reads_it(
    tmp_path, tiny_model, cli, text, share
):
    """The measure, run by name through the embedded analysis, selects the same H as the head
    statistics: where every token is punctuation every pair of H is both punctuation (share 1, for
    every head that has pairs), where none is, none (0)."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus

    corpus = tmp_path / "c.txt"
    corpus.write_text(f"{text}\n\n{text}\n", encoding="utf-8")
    db = tmp_path / "m.duckdb"
    run = analyze_corpus(
        str(corpus),
        store=Store(db),
        model=tiny_model,
        params=build_params(seq_len=32, measures=["punct_pairs"]),
        corpus=survey_corpus(str(corpus)),
        batch_size=4,
    )
    rows = json.loads(cli("query", "heads", "--db", str(db), "--run", str(run.run_id), "--format", "json").stdout)
    assert len(rows) == tiny_model.n_layers * tiny_model.n_heads
    with Store(db).read() as conn:
        _, named = named_sums_of(conn, run.run_id)
    assert {name for _, _, name, _ in named} == {SUM}
    for r in rows:
        assert r["high_pairs"] > 0 and r["both_punct_share"] == share and r["word_pairs_share"] == 1 - share


def test_analyze_asks_for_a_plugin_measure_by_name_and_refuses_one_not_installed(tmp_path, cli):
    """`analyze --measures punct_pairs`: the measure runs, is recorded in the run's parameters (a
    run with it is another run than one without), and its column sorts `query heads`; a name no
    installed plugin adds is refused before anything is created, naming the ones there are."""
    from sqlalchemy import text

    corpus = tmp_path / "c.txt"
    corpus.write_text(". , . , " * 40 + "\n", encoding="utf-8")
    db = tmp_path / "m.duckdb"
    tiny = ["--model", "random:tiny", "--seq-len", "32", "--db", str(db), "-q"]
    done = cli("analyze", str(corpus), *tiny, "--measures", "punct_pairs")
    assert done.returncode == 0, done.stderr
    rows = json.loads(cli("query", "heads", "--db", str(db), "--sort", "both_punct_share", "--format", "json").stdout)
    assert rows and all(r["both_punct_share"] == 1.0 for r in rows if r["high_pairs"])
    with Store(db).read() as conn:
        [(params,)] = conn.execute(text("SELECT params FROM runs")).all()
    assert params["measures"] == ["punct_pairs"]
    plain = cli("analyze", str(corpus), *tiny)
    assert plain.returncode == 0, plain.stderr
    with Store(db).read() as conn:
        assert conn.execute(text("SELECT count(*) FROM runs")).scalar() == 2  # another key
    other = tmp_path / "none.duckdb"
    refused = cli("analyze", str(corpus), "--model", "random:tiny", "--db", str(other), "--measures", "nope")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert "--measures 'nope': no measure of that name is installed; the plugins' measures are punct_pairs" in (
        refused.stderr
    )
    assert not other.exists()
