"""The vectorised statistics equal a plain per-window, per-head reference on real windows."""

from __future__ import annotations

import copy
import hashlib
import math

import numpy as np
import pytest
import torch

from headatlas.service.engine.analysis import analyze_batch
from headatlas.service.engine.corpus import iter_documents
from headatlas.service.engine.results import HEAD_SUMS, PAIR_HISTS
from headatlas.service.engine.windows import TokenClasses, collate, document_windows
from headatlas.service.params import AnalysisParams, Selection
from tests.reference import reference_windows, summed

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
    from headatlas.service.engine.corpus import demo_corpus_path

    docs = list(iter_documents(str(demo_corpus_path())))
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    first = document_windows(docs[0], model.tokenizer, tokens, model.tokenizer_key, params)
    return tokens, first[: count - 1] + [first[-1]]


def selection_count(select: Selection):
    """|H| of a window with n pairs, from SPEC §3 (written here, not service.params)."""
    if select.kind == "top":
        return lambda n_pairs: min(n_pairs, math.ceil(select.value * n_pairs - 1e-9))
    assert select.kind == "topk"
    return lambda n_pairs: min(n_pairs, int(select.value))


def assert_heads_equal(got: dict, expected: dict, where: str) -> None:
    for name in HEAD_SUMS:
        if name in INTEGER_SUMS:
            np.testing.assert_array_equal(got[name], expected[name], err_msg=f"{where}: {name}")
        else:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-9, atol=1e-9, err_msg=f"{where}: {name}")


INTEGER_SUMS = (
    "high_pairs",
    "same_sentence_high",
    "same_token_high",
    "attended_high",
    "same_word_high",
    "anchor_frequent",
    "anchored_windows",
)


# Two parameter sets take every branch the parameters choose between: the sentence source
# (segmenter / punct), the replicate groups (document / window), the selection (top:Q / topk:K),
# [CLS]/[SEP] in pairs or not, head vectors before or after W_O, and two window lengths and gates.
@pytest.mark.parametrize(
    "params",
    [
        AnalysisParams(),
        AnalysisParams(
            seq_len=64,
            sentences="punct",
            replicates="window",
            select=Selection("topk", 25),
            gate=2.0,
            include_special=True,
            vectors="post_wo",
        ),
    ],
    ids=["defaults", "punct-window-topk-special-post_wo-seq64"],
)
def test_vectorised_statistics_equal_reference(model64, params):
    tokens, windows = real_windows(model64, params)
    assert len(windows[-1].input_ids) < len(windows[0].input_ids), "need a padded window"
    batch = collate(windows, tokens.pad_id)
    result = analyze_batch(model64, batch, params, tokens)
    records = reference_windows(
        model64,
        batch.input_ids,
        batch.attention_mask,
        tokens,
        count=selection_count(params.select),
        gate=params.gate,
        include_special=params.include_special,
        seq_len=params.seq_len,
        vectors=params.vectors,
        sentences=batch.sentence,
    )
    # the batch totals (SPEC §4 and §5b)
    total = summed(records)
    assert set(HEAD_SUMS) == set(total["heads"]), "the reference must cover every head sum"
    assert_heads_equal(result.heads, total["heads"], "batch")
    np.testing.assert_array_equal(result.dist_hist, total["dist_hist"])
    np.testing.assert_array_equal(result.attended_hist, total["attended_hist"])
    assert set(result.chance) == set(total["chance"])
    for name, value in total["chance"].items():
        assert result.chance[name] == pytest.approx(value, rel=1e-12), name
    np.testing.assert_array_equal(result.pair_hist, total["hists"]["pairs"])
    for name in PAIR_HISTS:
        np.testing.assert_array_equal(result.rep_pair_hist[name].sum(0), total["hists"][name], err_msg=name)
    np.testing.assert_array_equal(result.anchor_token, np.stack([r["anchors"] for r in records]))
    np.testing.assert_array_equal(result.anchor_frequent, np.stack([r["anchor_frequent"] for r in records]))
    # the sums matter: word repeats and frequency anchors occur in these windows
    assert total["chance"]["same_word_pairs"] > 0 and total["chance"]["punct_tokens"] > 0
    assert total["heads"]["anchor_frequent"].sum() > 0
    assert total["chance"]["dup_rows"] > 0 and total["chance"]["induction_rows"] > 0  # SPEC §8 sums exercised
    assert (total["heads"]["same_token_high"] > total["heads"]["same_word_high"]).any()  # punctuation repeats in H
    assert total["attended_hist"].sum() > 0

    # per replicate group: each group's sums are the sums of its own windows; the group is a hash of
    # the window's document (SPEC §5d), or of its id under the old rule
    keys = [w.window_id if params.replicates == "window" else w.doc_id for w in batch.windows]
    groups = [int(hashlib.sha256(k.encode()).hexdigest()[:8], 16) % 16 for k in keys]
    assert result.reps.tolist() == sorted(set(groups))
    for index, group in enumerate(result.reps.tolist()):
        own = summed([r for r, g in zip(records, groups) if g == group])
        assert_heads_equal({k: v[index] for k, v in result.rep_heads.items()}, own["heads"], f"group {group}")
        np.testing.assert_array_equal(result.rep_dist_hist[index], own["dist_hist"])
        np.testing.assert_array_equal(result.rep_attended_hist[index], own["attended_hist"])
        for name, value in own["chance"].items():
            assert result.rep_chance[name][index] == pytest.approx(value, rel=1e-12), (group, name)
        for name in PAIR_HISTS:
            np.testing.assert_array_equal(result.rep_pair_hist[name][index], own["hists"][name], err_msg=name)
