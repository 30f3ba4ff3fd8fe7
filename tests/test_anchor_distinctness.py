"""Anchor distinctness per layer (SPEC §5): known answers worked out by hand, through the per-batch
sums and through the database to `query layers`.

A head's anchor in a window is the token most often at an end of its high-similarity pairs (-1:
the head has no pair). ``anchor_distinct_share`` of a layer = Σ over windows of the distinct
anchors among its anchored heads / Σ of those heads. The first definition (the share of windows
whose anchored heads *all* differ, kept as ``anchor_distinctness.distinct_share``) was 0 in every
layer of the demo: with 12 heads, one shared anchor in a window is enough to fail it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headatlas.service.storage.store import Store, anchor_layer_sums
from tests.test_baselines import W1, W2, W4, Z1, Z2, Z4, build_result, new_run, uniform_attn

# [window, layer, head]: 3 windows, 2 layers, 4 heads
ANCHORS = np.array(
    [
        [[5, 5, 7, 9], [1, 1, 1, 1]],  # window 0: layer 0 has 3 distinct of 4; layer 1, 1 of 4
        [[2, 3, -1, 4], [8, 9, 8, 9]],  # window 1: 3 of 3 anchored heads (all differ); 2 of 4
        [[-1, -1, -1, -1], [6, -1, -1, -1]],  # window 2: no anchored head in layer 0; 1 of 1
    ]
)
# layer 0: windows with an anchored head 2 (window 2 has none); all distinct in 1 (window 1);
#          distinct anchors 3 + 3 = 6 of 4 + 3 = 7 anchored heads → 6/7
# layer 1: windows 3; all distinct in 1 (window 2's single head); distinct 1 + 2 + 1 = 4 of 4 + 4 + 1 = 9 → 4/9
EXPECTED_SHARE = [6 / 7, 4 / 9]


def test_layer_sums_by_hand():
    windows, all_distinct, distinct, anchored = anchor_layer_sums(ANCHORS)
    assert windows.tolist() == [2, 3]
    assert all_distinct.tolist() == [1, 1]
    assert distinct.tolist() == [6, 4]
    assert anchored.tolist() == [7, 9]


def test_one_shared_anchor_among_twelve_heads_fails_the_all_distinct_rule():
    # why the first definition read 0 in every layer of MiniLM (12 heads): 11 anchors differ, two
    # heads share one; and in every demo window of every layer at least two heads did
    one_window = np.array([[[10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10]]])
    windows, all_distinct, distinct, anchored = anchor_layer_sums(one_window)
    assert (windows[0], all_distinct[0]) == (1, 0)  # the window counts as "not distinct"
    assert distinct[0] / anchored[0] == pytest.approx(11 / 12)  # the share that replaces it


def test_query_layers_reads_the_hand_made_share(tmp_path):
    from headatlas.service.reports import layer_queries

    store = Store(tmp_path / "anchors.duckdb")
    store.ensure_schema()
    run = new_run(store, "anchors", layers=2, heads=4)
    z = torch.stack([Z1, Z2, Z4])[:, None, None].expand(3, 2, 4, -1, -1)
    attn = torch.stack([uniform_attn(8)] * 3)[:, None, None].expand(3, 2, 4, -1, -1)
    result = build_result(["a0", "a1", "a2"], [W1, W2, W4], z, attn)
    result.anchor_token = ANCHORS.astype(np.int64)  # the anchors set by hand
    store.ingest(run, [(0, result)])
    with store.checked_read() as conn:
        columns, rows = layer_queries.layers(conn, run)
    shares = [r[columns.index("anchor_distinct_share")] for r in rows]
    assert shares == pytest.approx(EXPECTED_SHARE)
    assert "distinct_anchor_ratio" not in columns  # one column, the same number under its SPEC name
    store.compact(run)  # folded sums give the same answer
    with store.checked_read() as conn:
        columns, rows = layer_queries.layers(conn, run)
    assert [r[columns.index("anchor_distinct_share")] for r in rows] == pytest.approx(EXPECTED_SHARE)
