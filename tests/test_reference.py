"""The vectorised statistics equal a plain per-window, per-head reference on real windows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from service.analysis import analyze_batch
from service.corpus import iter_documents
from service.params import AnalysisParams, Selection
from service.stats import HEAD_SUMS
from service.windows import TokenClasses, collate, document_windows
from tests.reference import reference_statistics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model64(real_model):
    """The real model in float64, so that vectorised and reference rankings agree to the last pair."""
    m = copy.copy(real_model)
    m.model = copy.deepcopy(real_model.model).double()
    m.dtype = torch.float64
    return m


def real_windows(model, params, count=3):
    """Full windows and a short final window (so the batch is padded)."""
    from service.corpus import demo_corpus_path

    docs = list(iter_documents(str(demo_corpus_path())))
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    first = document_windows(docs[0], model.tokenizer, tokens, model.tokenizer_key, params)
    return tokens, first[: count - 1] + [first[-1]]


@pytest.mark.parametrize(
    "params",
    [
        AnalysisParams(),
        AnalysisParams(sentences="punct"),
        AnalysisParams(select=Selection("topk", 25), gate=2.0, include_special=True),
        AnalysisParams(seq_len=64, vectors="post_wo", select=Selection("top", 0.05), sentences="punct"),
    ],
    ids=["defaults", "punct", "topk-special", "post_wo-seq64-punct"],
)
def test_vectorised_statistics_equal_reference(model64, params):
    tokens, windows = real_windows(model64, params)
    assert len(windows[-1].input_ids) < len(windows[0].input_ids), "need a padded window"
    batch = collate(windows, tokens.pad_id)
    result = analyze_batch(model64, batch, params, tokens)
    heads, dist_hist, chance, pair_hist, anchors = reference_statistics(
        model64, batch.input_ids, batch.attention_mask, tokens, q=params.select.value if params.select.kind == "top" else None,
        gate=params.gate, include_special=params.include_special, seq_len=params.seq_len, vectors=params.vectors,
        sentences=batch.sentence,
    ) if params.select.kind == "top" else _reference_topk(model64, batch, tokens, params)
    for name in HEAD_SUMS:
        if name in ("high_pairs", "same_sentence_high", "same_token_high", "attended_high"):
            np.testing.assert_array_equal(result.heads[name], heads[name], err_msg=name)
        else:
            np.testing.assert_allclose(result.heads[name], heads[name], rtol=1e-9, atol=1e-9, err_msg=name)
    np.testing.assert_array_equal(result.dist_hist, dist_hist)
    assert result.chance == chance
    np.testing.assert_array_equal(result.pair_hist, pair_hist)
    np.testing.assert_array_equal(result.anchor_token, anchors)


def _reference_topk(model, batch, tokens, params):
    # topk:K is top:q with ceil(q·|P|) = K; the reference takes q per window, so run it per window
    outs = []
    for w in range(batch.input_ids.shape[0]):
        n = int(batch.attention_mask[w].sum())
        ids = batch.input_ids[w : w + 1, :n]
        m = n if params.include_special else n - 2
        n_pairs = m * (m - 1) // 2
        q = min(1.0, params.select.value / n_pairs)
        sentences = None if batch.sentence is None else batch.sentence[w : w + 1, :n]
        outs.append(reference_statistics(model, ids, batch.attention_mask[w : w + 1, :n], tokens, q=q, gate=params.gate,
                                         include_special=params.include_special, seq_len=params.seq_len,
                                         vectors=params.vectors, sentences=sentences))
    heads = {k: sum(o[0][k] for o in outs) for k in outs[0][0]}
    chance = {k: sum(o[2][k] for o in outs) for k in outs[0][2]}
    return (heads, sum(o[1] for o in outs), chance, sum(o[3] for o in outs),
            np.concatenate([o[4] for o in outs], axis=0))
