"""Neighbour retrieval beside embedding drift on a pruning curve (SPEC §9): known answers of top-1
and MRR on hand-made embeddings and sentences, then the real MiniLM on the shipped excerpt: the
intact model above chance, the stored values equal to a recomputation by hand (each sentence
through the Hugging Face model alone, removed heads' outputs set to their means by a hook of the
test's own), and a database from before the columns upgraded and read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

T95_1 = 12.7062  # t_{1, 0.975}


# --- known answers --------------------------------------------------------------------------------


def _tokens():
    from headatlas.service.engine.windows import TokenClasses

    return TokenClasses(
        cls_id=101,
        sep_id=102,
        pad_id=0,
        special_ids=frozenset({0, 101, 102}),
        sentence_end_ids=frozenset({1012}),
        punct_ids=frozenset({1012}),
    )


def test_sentences_come_from_the_windows_sentence_ids_else_from_punctuation() -> None:
    from headatlas.service.engine.windows import Window
    from headatlas.service.measures.retrieval import neighbour_task, window_sentences

    carried = Window("a", "d1", 0, (101, 5, 6, 1012, 7, 8, 102), (-1, 0, 0, 0, 1, 1, -1))
    # "Mr." is one sentence under the window's own ids, two under punct
    assert window_sentences(carried, _tokens()) == [(5, 6, 1012), (7, 8)]
    punct = Window("b", "d2", 0, (101, 9, 1012, 10, 1012, 11, 102))
    assert window_sentences(punct, _tokens()) == [(9, 1012), (10, 1012), (11,)]
    lone = Window("c", "d3", 0, (101, 12, 13, 102))  # one sentence: no query, no candidate
    task = neighbour_task([carried, punct, lone], _tokens())
    assert task.sentences[0] == (101, 5, 6, 1012, 102)  # each alone, with the window's specials
    assert task.window.tolist() == [0, 0, 1, 1, 1, 2]
    assert task.query.tolist() == [0, 2, 3] and task.target.tolist() == [1, 3, 4]
    assert task.candidates.tolist() == [1, 3, 4]


def _hand_task():
    from headatlas.service.measures.retrieval import NeighbourTask

    # three windows: sentences 0 1 2 | 3 4 | 5 6
    return NeighbourTask(
        sentences=[()] * 7,
        window=np.array([0, 0, 0, 1, 1, 2, 2]),
        query=np.array([0, 1, 3, 5]),
        target=np.array([1, 2, 4, 6]),
        candidates=np.array([1, 2, 4, 6]),
    )


def test_top1_and_mrr_of_hand_made_embeddings() -> None:
    from headatlas.service.measures.retrieval import ranks

    vectors = torch.tensor([[1, 0], [0, 1], [1, 1], [0, 1], [1, 1], [1, -1], [1, -1.1]], dtype=torch.float64)
    hits, reciprocal = ranks(vectors, _hand_task())
    # query 0 (1,0): s2 and s4 (cos .707) and s6 (.673) above its successor s1 (cos 0): rank 4
    # query 1 (0,1): itself left out; s2 (its successor) tied with s4: a draw, top-1 1/2, RR (1 + 1/2)/2
    # query 3 (0,1): s1 (cos 1) above, s4 (its successor) tied with s2: ranks 2 or 3, RR (1/2 + 1/3)/2
    # query 5 (1,-1): s6 first
    assert hits.tolist() == [0, 0.5, 0, 1]
    assert reciprocal == pytest.approx([1 / 4, 3 / 4, 5 / 12, 1])
    assert float(reciprocal.mean()) == pytest.approx(29 / 48)


def test_every_sentence_one_vector_scores_chance() -> None:
    from headatlas.service.measures.retrieval import ranks

    task = _hand_task()
    hits, reciprocal = ranks(torch.ones(7, 3, dtype=torch.float64), task)
    top1, mrr = task.chance()
    # a query ranks 4 candidates, or 3 where it is one of them (query 1 is sentence 2's predecessor
    # and itself a candidate)
    assert top1 == pytest.approx((1 / 4 + 1 / 3 + 1 / 4 + 1 / 4) / 4)
    h3, h4 = 1 + 1 / 2 + 1 / 3, 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert mrr == pytest.approx((h4 / 4 + h3 / 3 + h4 / 4 + h4 / 4) / 4)
    assert float(hits.mean()) == pytest.approx(top1) and float(reciprocal.mean()) == pytest.approx(mrr)


def test_the_interval_is_the_jackknife_over_the_queries_groups() -> None:
    from headatlas.service.measures.retrieval import with_interval

    value, lo, hi = with_interval(np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1]), clip=False)
    # without group 0: 1; without group 1: 0.5; half-width t_{1} · sqrt(1/2 · 2 · 0.25²)
    assert value == 0.75
    assert (lo, hi) == pytest.approx((0.75 - T95_1 * 0.25, 0.75 + T95_1 * 0.25), rel=1e-4)
    # as shown: within [0, 1], where a rate lies (a top-1 of 0.095 read "[-0.22, 0.40]")
    assert with_interval(np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1]))[1:] == (0.0, 1.0)
    hits = np.array([1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 0], dtype=float)  # groups at .5, .25, .75, .5
    narrow = with_interval(hits, np.repeat(np.arange(4), 4))  # 0.5 ± 0.325
    assert 0.0 < narrow[1] < 0.5 < narrow[2] < 1.0  # an interval inside [0, 1] is left as it is
    assert all(math.isnan(b) for b in with_interval(np.array([1.0, 0.0]), np.array([3, 3]))[1:])


# --- the real MiniLM on the shipped excerpt ---------------------------------------------------------

WINDOWS = 3


@pytest.fixture(scope="module")
def excerpt(tmp_path_factory, demo_corpus):
    """The excerpt's documents cut to their first 450 characters (one window of 128 tokens each)."""
    corpus = tmp_path_factory.mktemp("retrieval") / "corpus.txt"
    docs = [d.strip()[:450] for d in demo_corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    corpus.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return corpus


@pytest.fixture(scope="module")
def curves(excerpt, real_model):
    """The real MiniLM's layer-order curve at 0 and 100 % of the heads removed, on 3 evaluation
    windows (no order asked needs effects: none are measured), as ``prune`` stores its rows."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.operations.prune_curves import prune_curves

    params = build_params()
    result = prune_curves(
        str(excerpt), real_model, params, orders=("layer",), seeds=0, step=1.0, windows=WINDOWS, reference=4
    )
    columns, rows = result.rows()
    return result, [dict(zip(columns, r)) for r in rows], params


def _by_hand(model, corpus, params, removed: bool) -> tuple[float, float, float, float]:
    """Top-1, MRR and their chance on the prune's evaluation windows, every sentence through the
    Hugging Face model alone; ``removed``: every head's output (the input of each layer's
    attention output projection) set to its mean over the corpus's first 4 windows."""
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.run_plan import first_windows
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.operations.effect_runs import spread_windows

    hf = model.model
    tokens = TokenClasses.for_model(model)
    projections = [layer.attention.output.dense for layer in hf.encoder.layer]
    means = []
    if removed:
        sums = [torch.zeros(p.in_features, dtype=torch.float64) for p in projections]
        count = 0

        def take(i):
            def hook(_module, args) -> None:
                sums[i].add_(args[0][0].double().sum(dim=0))  # [pos, d_model] summed over positions

            return hook

        handles = [p.register_forward_pre_hook(take(i)) for i, p in enumerate(projections)]
        try:
            with torch.no_grad():
                for w in first_windows(str(corpus), model, params, tokens, 4):
                    hf(input_ids=torch.tensor([w.input_ids]))
                    count += len(w.input_ids)
        finally:
            for h in handles:
                h.remove()
        means = [(s / count).float() for s in sums]

    def fill(i):
        return lambda _module, args: (means[i].expand_as(args[0]),)

    handles = [p.register_forward_pre_hook(fill(i)) for i, p in enumerate(projections)] if removed else []
    try:
        spread = spread_windows(iter_documents(str(corpus)), model, params, 2 * WINDOWS)
        sentences = []  # (window, word pieces) in order
        for w_index, w in enumerate(spread[1::2]):  # the evaluation windows: every other of the spread
            assert w.sentence_ids is not None  # the default sentences: the segmenter's
            ids: dict[int, list[int]] = {}
            for token, sentence in zip(w.input_ids, w.sentence_ids, strict=True):
                if sentence >= 0:
                    ids.setdefault(sentence, []).append(token)
            sentences += [(w_index, ids[s]) for s in sorted(ids)]
        with torch.no_grad():
            vectors = []
            for _w, pieces in sentences:
                final = hf(input_ids=torch.tensor([[tokens.cls_id, *pieces, tokens.sep_id]])).last_hidden_state
                vectors.append(final[0].double().mean(dim=0))
    finally:
        for h in handles:
            h.remove()
    pairs = [(i, i + 1) for i in range(len(sentences) - 1) if sentences[i][0] == sentences[i + 1][0]]
    pool = [j for _i, j in pairs]
    cos = torch.nn.functional.cosine_similarity
    hits, reciprocal, chance, chance_mrr = [], [], [], []
    for i, j in pairs:
        others = [c for c in pool if c != i]
        true = float(cos(vectors[i], vectors[j], dim=0))
        rank = 1 + sum(float(cos(vectors[i], vectors[c], dim=0)) > true for c in others)
        hits.append(rank == 1)
        reciprocal.append(1 / rank)
        chance.append(1 / len(others))
        chance_mrr.append(sum(1 / r for r in range(1, len(others) + 1)) / len(others))
    return float(np.mean(hits)), float(np.mean(reciprocal)), float(np.mean(chance)), float(np.mean(chance_mrr))


def test_retrieval_equals_a_recomputation_by_hand_and_the_intact_model_beats_chance(
    curves, excerpt, real_model
) -> None:
    result, rows, params = curves
    assert [r["heads_removed"] for r in rows] == [0, 72]
    assert result.selection == "no effects: no order asked needs them"  # none measured: the layer order is blind
    intact, gone = rows
    top1, mrr, chance_top1, chance_mrr = _by_hand(real_model, excerpt, params, removed=False)
    assert (intact["top1"], intact["mrr"]) == pytest.approx((top1, mrr), abs=1e-9)
    assert result.retrieval is not None
    assert (result.retrieval.chance_top1, result.retrieval.chance_mrr) == pytest.approx((chance_top1, chance_mrr))
    # the intact model: clearly above chance on the excerpt
    assert intact["top1"] > 2 * chance_top1 and intact["mrr"] > 1.5 * chance_mrr, (intact, chance_top1, chance_mrr)
    top1, mrr, _c, _m = _by_hand(real_model, excerpt, params, removed=True)
    assert (gone["top1"], gone["mrr"]) == pytest.approx((top1, mrr), abs=1e-9)
    assert gone["mrr"] < intact["mrr"]  # every head gone: neighbours are found less well
    assert intact["top1_lo"] <= intact["top1"] <= intact["top1_hi"]  # 3 documents: 3 replicate groups


# --- stored with a run, and read from a database stored before ----------------------------------------


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, tiny_model, demo_corpus):
    """A run of the random encoder (embedding drift: retrieval measured) pruned in layer and random
    order, stored: (store, run, what was measured, what was stored)."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.operations.prune_runs import prune_run
    from headatlas.service.storage.store import Store

    folder = tmp_path_factory.mktemp("stored")
    corpus = folder / "small.txt"
    corpus.write_text("\n\n".join(demo_corpus.read_text(encoding="utf-8").split("\n\n")[:2]) + "\n", encoding="utf-8")
    store = Store(folder / "r.duckdb")
    params = build_params(seq_len=64)
    run = analyze_corpus(str(corpus), store=store, model=tiny_model, params=params, corpus=survey_corpus(str(corpus)))
    result, saved = prune_run(
        store, run, orders=["layer", "random"], step=0.5, seeds=1, windows=4, reference=2, model=tiny_model
    )
    return store, run, result, saved


def test_the_stored_rows_are_the_measured_ones(pruned) -> None:
    from headatlas.service.storage.effect_rows import retrieval_note

    _store, _run, result, saved = pruned
    columns, rows = result.rows()
    assert saved.columns == columns and "mrr_hi" in columns
    for stored, measured in zip(saved.rows, rows, strict=True):  # an interval not formed: NaN, stored NULL
        assert stored == pytest.approx(tuple(None if v != v else v for v in measured))
    assert result.retrieval is not None
    assert saved.meta["retrieval_queries"] == result.retrieval.queries
    assert saved.meta["chance_mrr"] == pytest.approx(result.retrieval.chance_mrr)
    said = retrieval_note(saved.meta)  # under the table and in the API's notes
    assert said is not None and said.startswith("top1, mrr: neighbour retrieval")
    assert (
        f"each of the {result.retrieval.queries} sentences" in said
        and f"ranks the {result.retrieval.candidates}" in said
    )


def test_a_database_from_before_the_retrieval_columns_upgrades_and_reads(pruned) -> None:
    """Down to 0017 (no retrieval columns) and up again: the prune reads as it did less its
    retrieval (NULL: the columns are left out), every other number kept."""
    from sqlalchemy import text
    from test_decoder_metrics import _alembic

    from headatlas.service.storage import db
    from headatlas.service.storage.effect_rows import load_prune

    store, run, _result, saved = pruned
    path = str(store.path)
    _alembic(path, "downgrade", "0017_effect_atp")
    with store.read() as conn:
        columns = {r[0] for r in conn.execute(text("SELECT column_name FROM information_schema.columns"))}
    assert not {"top1", "mrr", "chance_top1", "retrieval_queries"} & columns
    assert db.upgrade(path) == ("0017_effect_atp", db.head_revision())
    with store.read() as conn:
        old = load_prune(conn, run.run_id)
    assert old is not None and "top1" not in old.columns and old.meta["retrieval_queries"] is None
    kept = len(old.columns)
    assert old.columns == saved.columns[:kept]
    for before, after in zip(saved.rows, old.rows, strict=True):
        assert after == pytest.approx(before[:kept], nan_ok=True)
