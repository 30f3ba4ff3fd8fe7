"""Corpus-averaged similarity matrices (SPEC §5c): known answers on hand-made tensors, the payload,
the store, compaction and the view, and the stored mean against `inspect`'s matrix binned by hand."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from sqlalchemy import text

from headatlas.service.engine.features import window_features
from headatlas.service.engine.results import CSM_KINDS, BatchResult
from headatlas.service.engine.stats import head_statistics
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.params import AnalysisParams, Selection

CLS, SEP, PAD, DOT, A, B = 101, 102, 0, 1012, 1037, 1038
TOKENS = TokenClasses(
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
    special_ids=frozenset({CLS, SEP, PAD}),
    sentence_end_ids=frozenset({DOT}),
    punct_ids=frozenset({DOT}),
)
# [CLS] a b a b . [SEP] [PAD]: the pair universe is positions 1..5; bins of 2: {0,1} {2,3} {4,5} {6,7}
IDS = [CLS, A, B, A, B, DOT, SEP, PAD]
# d = 1, so C_ij = s_i s_j; [CLS], [SEP] and the pad are large but outside P
S = [9.0, 1.0, 2.0, 3.0, 1.0, 2.0, 9.0, 5.0]
# C over P by bin, by hand (upper triangle):
#   (0,0): position 1 alone, no pair          (0,1): 1·2 + 1·3 = 5, 2 pairs   (0,2): 1·1 + 1·2 = 3, 2 pairs
#   (1,1): (2,3) = 6, 1 pair                  (1,2): 2·1 + 2·2 + 3·1 + 3·2 = 15, 4 pairs
#   (2,2): (4,5) = 2, 1 pair                  bin 3 ([SEP], pad): nothing.   Σ = 31 = ((Σs)² − Σs²)/2
ALL_SUM = [[0, 5, 3, 0], [0, 6, 15, 0], [0, 0, 2, 0], [0, 0, 0, 0]]
ALL_PAIRS = [[0, 2, 2, 0], [0, 1, 4, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
# topk:2 takes the two pairs of C = 6: (2,3) and (3,5). The gate 2/n = 2/7: A[2,3] = 0.5 passes,
# (3,5) has uniform weight 1/7 both ways and fails → attended: cell (1,1); noise: cell (1,2).


def _window_stats(scales: list[float]):
    """Two windows of IDS; window w has z = scales[w] · S (so C scales by scales[w]²)."""
    ids = torch.tensor([IDS] * len(scales))
    feats = window_features(ids, (ids != PAD).long(), TOKENS)
    z = torch.tensor([[s * x for x in S] for s in scales], dtype=torch.float64)[:, None, :, None]
    attn = torch.zeros(len(scales), 1, 8, 8, dtype=torch.float64)
    attn[:, :, :, :7] = 1.0 / 7
    attn[:, :, 2, 3] = 0.5
    return head_statistics(z, attn, feats, select=Selection.parse("topk:2"), gate=2.0, seq_len=8, csm_bin=2)


def test_binned_sums_and_counts_by_hand():
    out = _window_stats([1.0])
    sums, counts = out["csm_sum"], out["csm_count"]  # [kind, head, bin, bin]
    assert sums.shape == counts.shape == (3, 1, 4, 4)
    assert sums[0, 0].tolist() == ALL_SUM
    assert counts[0, 0].tolist() == ALL_PAIRS
    attended = np.zeros((4, 4))
    attended[1, 1] = 6
    noise = np.zeros((4, 4))
    noise[1, 2] = 6
    assert sums[1, 0].numpy().tolist() == attended.tolist()
    assert sums[2, 0].numpy().tolist() == noise.tolist()
    assert counts[1, 0].numpy().tolist() == (attended > 0).astype(int).tolist()
    assert counts[2, 0].numpy().tolist() == (noise > 0).astype(int).tolist()
    # the all-pairs sums add up to sim_sum_all, the H cells to sim_sum_high
    assert float(sums[0].sum()) == pytest.approx(float(out["sim_sum_all"].sum())) == 31
    assert float(sums[1:].sum()) == pytest.approx(float(out["sim_sum_high"].sum())) == 12


def test_windows_add_up_and_full_resolution_is_the_matrix_itself():
    # a second window with z doubled: C × 4, the same pairs → sums × (1 + 4), counts × 2
    out = _window_stats([1.0, 2.0])
    assert (out["csm_sum"][0, 0] / 5).tolist() == ALL_SUM
    assert (out["csm_count"][0, 0] // 2).tolist() == ALL_PAIRS
    assert float(out["csm_sum"][1, 0, 1, 1]) == 30 and int(out["csm_count"][1, 0, 1, 1]) == 2
    ids = torch.tensor([IDS])
    feats = window_features(ids, (ids != PAD).long(), TOKENS)
    z = torch.tensor(S, dtype=torch.float64)[None, None, :, None]
    attn = torch.full((1, 1, 8, 8), 1 / 7, dtype=torch.float64)
    full = head_statistics(z, attn, feats, select=Selection.parse("topk:2"), gate=2.0, seq_len=8, csm_bin=1)
    members = np.array([0, 1, 1, 1, 1, 1, 0, 0], dtype=bool)
    expected = np.triu(np.outer(S, S) * np.outer(members, members), k=1)
    np.testing.assert_allclose(full["csm_sum"][0, 0].numpy(), expected)
    assert full["csm_count"][0, 0].numpy().tolist() == np.triu(np.outer(members, members), k=1).astype(int).tolist()


def test_csm_bin_is_in_the_run_key_only_when_not_the_default():
    from headatlas.service.errors import ParameterError

    default = AnalysisParams(sentences="punct")
    assert "csm_bin" not in default.to_dict()
    assert AnalysisParams(sentences="punct", csm_bin=8).key() == default.key()
    assert AnalysisParams(sentences="punct", csm_bin=1).to_dict()["csm_bin"] == 1
    assert AnalysisParams(sentences="punct", csm_bin=1).key() != default.key()
    assert AnalysisParams.from_dict(AnalysisParams(sentences="punct", csm_bin=1).to_dict()).csm_bin == 1
    assert default.csm_bins == 16 and AnalysisParams(sentences="punct", seq_len=20, csm_bin=8).csm_bins == 3
    assert AnalysisParams(sentences="punct", seq_len=6).csm_bins == 1  # the default bin fits any window
    with pytest.raises(ParameterError, match=r"--csm-bin -1: must be 0 \(no averaged matrices\) or more"):
        AnalysisParams(csm_bin=-1)


# --- through the payload, the store, compaction and the view ---------------------------------------

ONE_WINDOW = "The cat sat on the mat. The dog sat on the log, and the cat saw the dog. Then both slept."


def _analyse(corpus, db, model, **options):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.storage.store import Store

    return analyze_corpus(
        str(corpus),
        store=Store(db),
        model=model,
        params=build_params(**options),
        corpus=survey_corpus(str(corpus)),
        batch_size=4,
    )


def _grid(columns, rows, *, head: int, kind: str, value: str, n_bins: int) -> np.ndarray:
    grid = np.full((n_bins, n_bins), np.nan)
    for r in rows:
        row = dict(zip(columns, r))
        if row["head"] == head and row["kind"] == kind:
            grid[row["bin_i"], row["bin_j"]] = row[value]
    return grid


def test_payload_store_compaction_and_view_keep_the_sums(tmp_path, tiny_model, small_corpus):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.reports import queries
    from headatlas.service.storage.store import Store

    params = build_params()
    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    made = [
        (analyze_batch(tiny_model, b, params, tokens, documents=docs))
        for b, docs, _ in iter_batches(str(small_corpus), tiny_model, params, tokens, batch_size=4)
    ]
    assert len(made) >= 2
    # the queue carries the bytes: what the writer reads back is what the worker made
    results = [BatchResult.from_bytes(r.to_bytes()) for r in made]
    for a, b in zip(made, results):
        assert int(b.measures["csm"]["bin"]) == 8 and b.measures["csm"]["sum"].shape == (3, 2, 4, 16, 16)
        np.testing.assert_array_equal(a.measures["csm"]["sum"], b.measures["csm"]["sum"])
        np.testing.assert_array_equal(a.measures["csm"]["count"], b.measures["csm"]["count"])
        np.testing.assert_array_equal(a.rep_same_sentence_hist, b.rep_same_sentence_hist)
    store = Store(tmp_path / "csm.duckdb")
    store.ensure_schema()
    run, _ = store.find_or_create_run(
        run_key="csm",
        name="csm",
        corpus=str(small_corpus),
        corpus_fingerprint="fp",
        model={"spec": tiny_model.name, "name": tiny_model.name, "layers": 2, "heads": 4, "d_head": 8},
        params=params.to_dict(),
        engine="embedded",
        device="cpu",
    )
    # a transaction per batch (one transaction's batches are summed when stored): compaction has rows to fold
    assert sum(store.ingest(run.run_id, [(i, r)]) for i, r in enumerate(results)) == len(results)
    total_sum = sum(r.measures["csm"]["sum"].astype(np.float64) for r in results)
    total_count = sum(r.measures["csm"]["count"].astype(np.int64) for r in results)
    with store.read() as conn:
        rows_before = conn.execute(text("SELECT count(*) FROM csm_bins WHERE run_id = :r"), {"r": run.run_id}).scalar()
        before = {layer: queries.csm(conn, run.run_id, layer=layer) for layer in (0, 1)}
    store.compact(run.run_id)
    with store.read() as conn:
        rows_after = conn.execute(text("SELECT count(*) FROM csm_bins WHERE run_id = :r"), {"r": run.run_id}).scalar()
        after = {layer: queries.csm(conn, run.run_id, layer=layer) for layer in (0, 1)}
    assert rows_after < rows_before
    for layer in (0, 1):
        columns, rows = before[layer]
        assert after[layer][0] == columns
        np.testing.assert_allclose(
            np.array([r[5:7] for r in after[layer][1]], dtype=float),
            np.array([r[5:7] for r in rows], dtype=float),
            rtol=1e-12,
        )
        for head in range(4):
            for k, kind in enumerate(CSM_KINDS):
                count = total_count[k, layer, head]
                with np.errstate(invalid="ignore", divide="ignore"):
                    expected = np.where(count > 0, total_sum[k, layer, head] / count, np.nan)
                got = _grid(columns, rows, head=head, kind=kind, value="mean", n_bins=16)
                np.testing.assert_allclose(got, expected, rtol=1e-9, equal_nan=True)
                share = _grid(columns, rows, head=head, kind=kind, value="pair_share", n_bins=16)
                with np.errstate(invalid="ignore", divide="ignore"):
                    np.testing.assert_allclose(
                        share, np.where(count > 0, count / total_count[0, layer, head], np.nan), equal_nan=True
                    )


def test_stored_mean_of_one_window_is_the_inspected_matrix_binned_by_hand(tmp_path, tiny_model):
    from headatlas.service.analysis_options import build_params
    from headatlas.service.reports import queries
    from headatlas.service.reports.inspection import inspect_text
    from headatlas.service.storage.store import Store

    corpus = tmp_path / "one.txt"
    corpus.write_text(ONE_WINDOW + "\n", encoding="utf-8")
    run = _analyse(corpus, tmp_path / "one.duckdb", tiny_model)
    insp = inspect_text(tiny_model, ONE_WINDOW, build_params())
    n = len(insp.tokens)
    assert not insp.truncated and 20 < n < 64
    pair = np.triu(np.outer(insp.in_pairs, insp.in_pairs), k=1)
    cell_i, cell_j = np.meshgrid(np.arange(n) // 8, np.arange(n) // 8, indexing="ij")
    with Store(tmp_path / "one.duckdb").checked_read() as conn:
        for layer in range(insp.n_layers):
            columns, rows = queries.csm(conn, run.run_id, layer=layer)
            for head in range(insp.n_heads):
                attn = insp.attention[layer, head]
                gate = np.maximum(attn, attn.T) >= 4.0 / n  # SPEC §3, the default gate
                high = insp.high[layer, head] & pair
                for kind, chosen in (("all", pair), ("attended", high & gate), ("noise", high & ~gate)):
                    sums, counts = np.zeros((16, 16)), np.zeros((16, 16))
                    np.add.at(sums, (cell_i[chosen], cell_j[chosen]), insp.csm[layer, head][chosen])
                    np.add.at(counts, (cell_i[chosen], cell_j[chosen]), 1)
                    with np.errstate(invalid="ignore", divide="ignore"):
                        expected = np.where(counts > 0, sums / counts, np.nan)
                    got = _grid(columns, rows, head=head, kind=kind, value="mean", n_bins=16)
                    np.testing.assert_allclose(
                        got, expected, rtol=1e-4, atol=1e-5, equal_nan=True, err_msg=f"layer {layer} head {head} {kind}"
                    )
                    assert (
                        np.nansum(_grid(columns, rows, head=head, kind=kind, value="pairs", n_bins=16)) == counts.sum()
                    )
            assert int(high.sum()) == int(np.ceil(0.02 * pair.sum()))


def test_a_run_without_matrices_says_how_to_get_them(tmp_path, tiny_model):
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import queries
    from headatlas.service.storage.store import Store

    corpus = tmp_path / "one.txt"
    corpus.write_text(ONE_WINDOW + "\n", encoding="utf-8")
    run = _analyse(corpus, tmp_path / "none.duckdb", tiny_model, csm_bin=0)
    with Store(tmp_path / "none.duckdb").checked_read() as conn:
        assert conn.execute(text("SELECT count(*) FROM csm_bins")).scalar() == 0
        with pytest.raises(ParameterError, match=r"has no averaged similarity matrices \(analysed with --csm-bin 0\)"):
            queries.csm(conn, run.run_id, layer=0)
        with pytest.raises(ParameterError, match="--kind 'signal': choose one of all, attended, noise"):
            queries.csm(conn, run.run_id, layer=0, kind="signal")


def test_batches_stored_without_the_new_sums_are_never_drawn_as_whole(tmp_path):
    """A payload made before the matrices and the per-distance sentence counts (a worker of the
    previous version): the run's matrices and within-sentence-by-distance are refused, not partial."""
    from headatlas.service.errors import ParameterError
    from headatlas.service.reports import distance_queries, queries
    from headatlas.service.storage.store import Store
    from tests.test_baselines import W1, W3, Z1, Z3, build_result, ids_in_distinct_groups, new_run, uniform_attn

    store = Store(tmp_path / "mixed.duckdb")
    store.ensure_schema()
    run = new_run(store, "mixed")
    old = build_result(
        ids_in_distinct_groups(2),
        [W1, W3],
        torch.stack([Z1, Z3])[:, None, None],
        torch.stack([uniform_attn(8), uniform_attn(7)])[:, None, None],
    )
    assert "csm" not in old.measures and old.rep_same_sentence_hist is None
    new = BatchResult.from_bytes(old.to_bytes())
    new.window_ids = [w + "-new" for w in new.window_ids]
    new.rep_same_sentence_hist = new.rep_dist_hist.copy()
    new.measures["csm"] = {
        "bin": np.array(8),
        "sum": np.ones((3, 1, 1, 1, 1)),
        "count": np.ones((3, 1, 1, 1, 1), dtype=np.int64),
    }
    store.ingest(run, [(0, old), (1, new)])
    with store.read() as conn:
        assert conn.execute(text("SELECT count(*) FROM csm_bins")).scalar() == 3
        assert conn.execute(text("SELECT count(*) FROM dist_hist WHERE same_sentence IS NOT NULL")).scalar() == 0
        with pytest.raises(ParameterError, match="cover only some windows"):
            queries.csm(conn, run, layer=0)
        with pytest.raises(ParameterError, match="stored before within-sentence pairs were counted by distance"):
            distance_queries.sentence_by_distance(conn, run)
    store.compact(run)  # folding the batches keeps the gap visible
    with store.read() as conn, pytest.raises(ParameterError, match="cover only some windows"):
        queries.csm(conn, run, layer=0)


def test_the_stored_cells_come_in_bounded_record_batches_as_the_dense_sums_give_them(monkeypatch):
    from headatlas.service.storage import batch_rows

    g = np.random.default_rng(0)
    shape = (len(CSM_KINDS), 3, 2, 6, 6)  # [kind, layer, head, bin, bin]

    def payload(bins: int) -> dict[str, np.ndarray]:
        count = (g.random((*shape[:3], bins, bins)) < 0.3) * g.integers(1, 5, (*shape[:3], bins, bins))
        return {"sum": (g.random(count.shape) * (count > 0)).astype(np.float32), "count": count.astype(np.int32)}

    batches = [payload(6), payload(4)]  # a batch of shorter windows has fewer bins
    pairs = np.zeros(shape, np.int64)
    sums = np.zeros(shape, np.float64)
    for b in batches:
        part = tuple(slice(0, n) for n in b["count"].shape)
        pairs[part] += b["count"]
        sums[part] += np.where(b["count"] != 0, b["sum"].astype(np.float64), 0.0)
    ki, lc, hc, bi, bj = np.nonzero(pairs)
    monkeypatch.setattr(batch_rows, "CSM_ROWS_PER_BATCH", 5)
    reader = batch_rows.csm_rows(7, 3, batches, n_layers=3, n_heads=2)
    got = [b for b in reader]
    assert max(b.num_rows for b in got) <= 5 and sum(b.num_rows for b in got) == ki.size
    table = pa.Table.from_batches(got).to_pydict()
    assert table["run_id"] == [7] * ki.size and table["batch_id"] == [3] * ki.size
    assert table["kind"] == [CSM_KINDS[k] for k in ki]
    assert (table["layer"], table["head"], table["bin_i"], table["bin_j"]) == tuple(
        a.tolist() for a in (lc, hc, bi, bj)
    )
    assert table["pairs"] == pairs[ki, lc, hc, bi, bj].tolist()
    assert table["sim_sum"] == sums[ki, lc, hc, bi, bj].tolist()  # the same float64 sums, bit for bit
