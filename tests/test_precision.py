"""Half precision: a bfloat16 forward (autocast) gives summaries that agree with float32.

Tolerances: identical pair counts; per-layer within-sentence share and noise share within
0.03 absolute; mean distance within 5 %; attention means within 0.02 absolute; per head,
the top-pair sets overlap (same_sentence_high within 10 % of high_pairs).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from precision_checks import assert_half_agrees

from headatlas.service.engine.analysis import analyze_batch
from headatlas.service.engine.corpus import iter_documents
from headatlas.service.engine.windows import TokenClasses, collate, document_windows
from headatlas.service.params import AnalysisParams

pytestmark = pytest.mark.slow


def test_bfloat16_summaries_agree_with_float32(real_model, demo_corpus):
    params = AnalysisParams()
    tokens = TokenClasses.from_tokenizer(real_model.tokenizer)
    doc = next(iter_documents(str(demo_corpus)))
    batch = collate(
        document_windows(doc, real_model.tokenizer, tokens, real_model.tokenizer_key, params)[:6], tokens.pad_id
    )
    full = analyze_batch(real_model, batch, params, tokens)
    half_model = copy.copy(real_model)
    half_model.dtype = torch.bfloat16
    half = analyze_batch(half_model, batch, params, tokens)
    assert_half_agrees(full, half)
    high = full.heads["high_pairs"]
    d = np.arange(params.seq_len)
    mean_d = lambda r: (r.dist_hist * d).sum(2).sum(1) / r.heads["high_pairs"].sum(1)  # noqa: E731
    np.testing.assert_allclose(mean_d(half), mean_d(full), rtol=0.05)
    diff = np.abs(half.heads["same_sentence_high"] - full.heads["same_sentence_high"]) / high
    assert diff.max() < 0.10
