"""Out-of-memory recovery: a batch that does not fit is halved, and the sums do not change."""

from __future__ import annotations

import numpy as np
import torch

import headatlas.service.engine.analysis as analysis
from headatlas.service.engine.run_plan import iter_batches
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.params import AnalysisParams


def test_batches_that_run_out_of_memory_are_halved_without_changing_the_sums(tiny_model, small_corpus, monkeypatch):
    params = AnalysisParams()
    tokens = TokenClasses.from_tokenizer(tiny_model.tokenizer)
    batch, docs, _ = next(iter_batches(str(small_corpus), tiny_model, params, tokens, batch_size=8))
    assert len(batch.windows) == 8
    whole = analysis.analyze_batch(tiny_model, batch, params, tokens, documents=docs)

    real = analysis.analyze_batch
    sizes = []

    def device_with_room_for_three(model, b, *args, **kwargs):
        # stands in for a GPU that fits three windows; the splitting logic is what is tested
        sizes.append(len(b.windows))
        if len(b.windows) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, b, *args, **kwargs)

    monkeypatch.setattr(analysis, "analyze_batch", device_with_room_for_three)
    splitter = analysis.OomSplitter()
    parts = splitter.analyze(tiny_model, batch, params, tokens, docs, pad_id=tokens.pad_id)
    assert sizes == [8, 4, 2, 2, 2, 2]
    assert splitter.max_windows == 2
    assert sum(len(p.window_ids) for p in parts) == 8
    for key, value in whole.heads.items():
        np.testing.assert_allclose(sum(p.heads[key] for p in parts), value, rtol=1e-9, err_msg=key)
    np.testing.assert_array_equal(sum(p.dist_hist for p in parts), whole.dist_hist)
    # later batches are split up front, without another failure
    sizes.clear()
    splitter.analyze(tiny_model, batch, params, tokens, docs, pad_id=tokens.pad_id)
    assert sizes == [2, 2, 2, 2]
