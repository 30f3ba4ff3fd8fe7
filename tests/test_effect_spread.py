"""Which windows get the causal effects (SPEC §9, engine/effect_spread.py): N windows spread over
the run's replicate groups, the k-th from a group holding fewer than ceil(k / 8) of them (at most
ceil(N / 8) in a group), so that their intervals rest on 8 groups wherever the corpus has them,
in one order whatever N is; a corpus that ends first goes on by rank in the group. Known
answers on hand-made groups, then the shipped excerpt (whose first 8 windows are one document's,
one group), a one-document corpus, the batch and the worker taking the windows named, and runs
stored before the rule (their parameters without ``effect_spread``) keeping their first N."""

from __future__ import annotations

import base64
import dataclasses
import random

import numpy as np
import pytest

from headatlas.service.analysis_options import EFFECT_WINDOWS, build_params
from headatlas.service.engine.effect_spread import group_cap, spread

# --- known answers --------------------------------------------------------------------------------


def _items(groups: str) -> list[tuple[int, str]]:
    """(position, group) of hand-made windows: one letter a window, its group."""
    return list(enumerate(groups))


def _spread(groups: str, count: int) -> list[int]:
    items = _items(groups)
    return [p for p, _g in spread(lambda: iter(items), lambda item: ord(item[1]), count)]


def test_the_kth_window_is_taken_from_a_group_holding_fewer_than_k_over_8() -> None:
    assert [group_cap(n) for n in (1, 8, 9, 16, 17, 64)] == [1, 1, 2, 2, 3, 8]
    # 8 windows: one of each group, in corpus order, the rest of a group passed over
    assert _spread("AAAABBBCDDEFFGHHII", 8) == [0, 4, 7, 8, 10, 11, 13, 14]
    # 16 windows: one of each of 8 groups, then the waiting second ones of A, B, D, F (earliest
    # first), then H's second, I's and J's (K is never reached: 16 are taken by then)
    assert _spread("AAAABBBCDDEFFGHHIIJJKK", 16) == [0, 1, 4, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    # the first N by position would have been AAAABBBC: 3 groups
    assert len({"AAAABBBCDDEFFGHHII"[p] for p in _spread("AAAABBBCDDEFFGHHII", 8)}) == 8


def test_a_corpus_that_ends_first_is_filled_level_by_level_in_corpus_order() -> None:
    # 4 windows, 2 groups: one each, then those waiting by their rank in the group (A's 2nd, 3rd)
    assert _spread("AAAAAB", 4) == [0, 1, 2, 5]
    # 5: one each, then the 2nd of A and of B, then A's 3rd (earlier than B's)
    assert _spread("AAAAABBBB", 5) == [0, 1, 2, 5, 6]
    assert _spread("AAAAABBBB", 8) == [0, 1, 2, 3, 5, 6, 7, 8]
    assert _spread("ABAB", 8) == [0, 1, 2, 3]  # no more windows than asked: all of them
    assert _spread("AAA", 0) == []
    walks = []

    def walk():
        walks.append(1)
        return iter(_items("AABBCCDDEEFFGGHH"))

    spread(walk, lambda item: ord(item[1]), 8)
    assert len(walks) == 1  # N taken straight from the walk: one walk, stopped there
    walks.clear()
    spread(walk, lambda item: ord(item[1]), 9)
    assert len(walks) == 2  # the 9th is A's second, which waited: read again


def test_the_windows_for_n_are_among_those_for_more() -> None:
    """What ``effects RUN --windows`` relies on: asked for more, a run measures only the new ones."""
    rng = random.Random(0)
    for _ in range(200):
        groups = "".join(rng.choice("ABCDEFGHIJKLMNOP"[: rng.randint(1, 16)]) for _ in range(rng.randint(1, 80)))
        smaller = rng.randint(1, 40)
        larger = smaller + rng.randint(1, 40)
        assert set(_spread(groups, smaller)) <= set(_spread(groups, larger)), (groups, smaller, larger)
        assert len(_spread(groups, smaller)) == min(smaller, len(groups))


# --- on real windows --------------------------------------------------------------------------------


def _groups_of(params, windows) -> set[int]:
    from headatlas.service.engine.results import window_group

    return {window_group(params.replicates, window_id=w.window_id, doc_id=w.doc_id, index=w.index) for w in windows}


def _targets(corpus, model, count: int, **options):
    from headatlas.service.engine.run_plan import effect_targets, survey_corpus
    from headatlas.service.engine.windows import TokenClasses

    params = build_params(effects="zero", effect_windows=count, **options).resolved(survey_corpus(str(corpus)).distinct)
    return params, effect_targets(str(corpus), model, params, TokenClasses.for_model(model))


def test_the_excerpts_effect_windows_fill_every_group_it_has(tiny_model, demo_corpus) -> None:
    """The shipped excerpt (the default tokenizer: MiniLM's windows) has 7 groups under block:8;
    its first 8 windows are one document's first block, one group."""
    params, first = _targets(demo_corpus, tiny_model, 8, effect_spread="first")
    assert params.replicates == "block:8" and len(_groups_of(params, [w for _, w in first])) == 1
    for count in (8, 16, EFFECT_WINDOWS):
        params, chosen = _targets(demo_corpus, tiny_model, count)
        windows = [w for _, w in chosen]
        assert len(_groups_of(params, windows)) == 7, count  # all the excerpt has
        assert len(windows) == min(count, 52)
        assert [p for p, _ in chosen] == sorted(p for p, _ in chosen)  # in corpus order, positions in the run


def test_a_one_document_corpus_spreads_over_its_blocks_and_says_how_many(tiny_model, demo_corpus, tmp_path) -> None:
    from headatlas.service.engine.effect_spread import groups_held

    corpus = tmp_path / "one.txt"
    corpus.write_text(" ".join(demo_corpus.read_text(encoding="utf-8").split()) + "\n", encoding="utf-8")
    params, chosen = _targets(corpus, tiny_model, 8)
    windows = [w for _, w in chosen]
    assert params.replicates == "block:8" and len({w.doc_id for w in windows}) == 1
    assert len(windows) == 8  # the fill: more windows of its blocks where the blocks are fewer than 8
    _params, every = _targets(corpus, tiny_model, 10_000)
    present = _groups_of(params, [w for _, w in every])
    assert _groups_of(params, windows) == present  # every group the corpus has
    said = groups_held(params.replicates, windows)
    assert said == f"they fall in {len(present)} replicate groups, fewer than 8: rough intervals"


@pytest.fixture(scope="module")
def excerpt_effects(tiny_model, demo_corpus, tmp_path_factory):
    """The excerpt analysed, then `effects RUN` with its default windows added: (store, run)."""
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.added_effects import add
    from headatlas.service.operations.embedded_run import analyze_corpus
    from headatlas.service.operations.requests import AddEffectsRequest
    from headatlas.service.storage.store import Store

    store = Store(tmp_path_factory.mktemp("spread") / "x.duckdb")
    params = build_params()  # the windows the default model makes of it: 52, in 7 groups
    run = analyze_corpus(
        str(demo_corpus), store=store, model=tiny_model, params=params, corpus=survey_corpus(str(demo_corpus))
    )
    added = add(store, AddEffectsRequest.build(run.run_id, kinds="zero"), model=tiny_model)
    return store, added


def test_the_default_effect_windows_of_the_excerpt_have_finite_intervals(excerpt_effects) -> None:
    from headatlas.service.reports import queries
    from headatlas.service.storage.effect_rows import effect_groups, effect_note

    store, added = excerpt_effects
    assert added.windows == 16 and added.run.params["effect_spread"] == "groups"
    with store.read() as conn:
        groups = effect_groups(conn, added.run.run_id)
        columns, rows = queries.heads(conn, added.run.run_id, ci=True)
        note = effect_note(conn, added.run.run_id)
    assert len(groups) == 7
    for row in rows:
        head = dict(zip(columns, row))
        assert np.isfinite([head["effect_zero_lo"], head["effect_zero_hi"]]).all(), head
    assert "16 windows spread over the run's replicate groups (at most 2 in a group" in note
    assert "the 7 replicate groups that hold these windows, fewer than 8" in note


def test_windows_added_to_a_run_are_stored_under_their_positions_in_it(excerpt_effects, tiny_model) -> None:
    """`effects RUN` stores each window as batch EFFECT_BATCH_BASE + its position in the run: spread
    windows' positions have gaps, and asking again finds every one stored."""
    from sqlalchemy import text

    from headatlas.service.engine.run_plan import effect_targets
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.operations.added_effects import EFFECT_BATCH_BASE, effect_windows
    from headatlas.service.params import AnalysisParams

    store, added = excerpt_effects
    params = AnalysisParams.from_dict(added.run.params)
    tokens = TokenClasses.for_model(tiny_model)
    chosen = effect_windows(store, added.run, tiny_model, params, tokens)
    positions = [p for p, _w in effect_targets(added.run.corpus, tiny_model, params, tokens)]
    assert chosen.todo == [] and chosen.analysed == 0 and chosen.added == positions != list(range(16))
    with store.read() as conn:
        ids = conn.execute(
            text("SELECT batch_id FROM batches WHERE run_id = :r AND batch_id >= :b ORDER BY batch_id"),
            {"r": added.run.run_id, "b": EFFECT_BATCH_BASE},
        ).scalars()
        assert [i - EFFECT_BATCH_BASE for i in ids] == positions


# --- the batch, the OOM splitter and the worker take the windows named ---------------------------------


def test_a_batch_split_or_sent_to_a_worker_measures_the_windows_named(tiny_model, small_corpus, monkeypatch) -> None:
    import headatlas.workers.tasks as tasks
    from headatlas.service.engine.analysis import OomSplitter, analyze_batch
    from headatlas.service.engine.results import BatchResult
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.errors import ParameterError

    params = build_params(seq_len=32, sentences="punct", effects="zero", effect_windows=2).resolved(2)
    tokens = TokenClasses.for_model(tiny_model)
    batch, docs, _ = next(iter_batches(str(small_corpus), tiny_model, params, tokens, batch_size=5))
    named = analyze_batch(tiny_model, batch, params, tokens, documents=docs, windows={"effects": (1, 3)})
    alone = collate([batch.windows[1], batch.windows[3]], tokens.pad_id)
    both = analyze_batch(tiny_model, alone, params, tokens, windows={"effects": 2})
    assert named.effects["windows"] == 2
    np.testing.assert_allclose(named.rep_heads["effect_zero"].sum(0), both.rep_heads["effect_zero"].sum(0), rtol=1e-6)
    splitter = OomSplitter()
    splitter.max_windows = 2
    parts = splitter.analyze(tiny_model, batch, params, tokens, docs, pad_id=tokens.pad_id, windows={"effects": (1, 3)})
    assert [p.effects["windows"] for p in parts] == [1, 1, 0]  # windows 0-1, 2-3, 4
    total = sum(p.rep_heads["effect_zero"].sum(0) for p in parts)
    np.testing.assert_allclose(total, both.rep_heads["effect_zero"].sum(0), rtol=1e-6)

    class Settings:
        attribution_chunk = 2048

    monkeypatch.setattr(tasks, "_settings", lambda: Settings)
    message = {
        "database_id": "db",
        "model": "random:tiny",
        "dtype": "float32",
        "params": params.to_dict(),
        "tokenizer_key": tiny_model.tokenizer_key,
        "windows": [w.to_message() for w in batch.windows],
        "documents": docs,
        "first_window": 0,
        "takes": {"effects": [1, 3]},
    }
    worked = BatchResult.from_bytes(base64.b64decode(tasks._analyse(tiny_model, message)))
    np.testing.assert_allclose(worked.rep_heads["effect_zero"], named.rep_heads["effect_zero"], rtol=1e-6)
    with pytest.raises(ParameterError, match="names no windows for effects"):
        tasks._analyse(tiny_model, {k: v for k, v in message.items() if k != "takes"})


# --- runs stored before the rule ------------------------------------------------------------------------


def test_runs_stored_before_keep_their_first_n_and_their_key() -> None:
    from headatlas.service.params import AnalysisParams

    first = build_params(effects="zero,mean", effect_windows=8, effect_spread="first")
    stored = first.to_dict()
    assert "effect_spread" not in stored  # as a run stored before the rule records its parameters
    assert AnalysisParams.from_dict(stored).effect_spread == "first"
    assert AnalysisParams.from_dict(stored).key() == first.key()  # found and resumed under its key
    spread_run = build_params(effects="zero,mean", effect_windows=8)
    assert spread_run.to_dict()["effect_spread"] == "groups" and spread_run.key() != first.key()
    # a run without effects records neither; effects added to it later are spread
    plain = build_params().to_dict()
    assert "effect_spread" not in plain and AnalysisParams.from_dict(plain).effect_spread == "groups"
    assert dataclasses.replace(AnalysisParams.from_dict(stored), effects=()).key() == build_params().key()
