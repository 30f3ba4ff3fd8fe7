"""Neighbour retrieval beside embedding drift on a pruning curve (SPEC §9): known answers of top-1
and MRR on hand-made embeddings and sentences."""

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

    value, lo, hi = with_interval(np.array([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1]))
    # without group 0: 1; without group 1: 0.5; half-width t_{1} · sqrt(1/2 · 2 · 0.25²)
    assert value == 0.75
    assert (lo, hi) == pytest.approx((0.75 - T95_1 * 0.25, 0.75 + T95_1 * 0.25), rel=1e-4)
    assert all(math.isnan(b) for b in with_interval(np.array([1.0, 0.0]), np.array([3, 3]))[1:])
