"""The similarity matrix's top pairs computed in row chunks equal the whole-matrix selection:
the same pairs under SPEC §3's tie rule, and the same statistics, for every selection kind."""

from __future__ import annotations

import pytest
import torch

from headatlas.service.engine.features import window_features
from headatlas.service.engine.pair_selection import (
    masked_similarity,
    rerank_unresolved,
    select_pairs,
    select_pairs_chunked,
    similarity_chunk_rows,
    unresolved_rows,
)
from headatlas.service.engine.stats import head_statistics
from headatlas.service.params import Selection
from tests.chunk_support import CLS, PAD, SEP, TOKENS, Largest


def _batch(seed: int, n_pos: int = 23, batch: int = 3, heads: int = 2, levels: int = 3):
    """Windows of different lengths (padding, specials) and head vectors with few distinct
    values, so that the similarity matrix is full of exact ties (small integers)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 12, (batch, n_pos), generator=gen)
    mask = torch.ones(batch, n_pos, dtype=torch.long)
    for b in range(batch):
        n = n_pos - 5 * b
        ids[b, 0], ids[b, n - 1] = CLS, SEP
        ids[b, n:], mask[b, n:] = PAD, 0
    z = torch.randint(-1, levels, (batch, heads, n_pos, 4), generator=gen).float()
    attn = torch.softmax(torch.randn(batch, heads, n_pos, n_pos, generator=gen), dim=3)
    return window_features(ids, mask, TOKENS), z, attn


def _chosen_pairs(values, index, chosen):
    """Per (window, head): the chosen pair indices as a set and their values in rank order."""
    out = []
    for b in range(index.shape[0]):
        for h in range(index.shape[1]):
            pick = chosen[b, h]
            out.append((sorted(index[b, h][pick].tolist()), values[b, h][pick].tolist()))
    return out


@pytest.mark.parametrize("select", ["top:0.02", "top:0.3", "topk:1", "topk:7", "topk:400", "ratio:0.5", "ratio:1"])
@pytest.mark.parametrize("rows", [1, 2, 5, 22])
def test_chunked_selection_picks_the_same_pairs(select, rows):
    for seed in range(3):
        feats, z, _attn = _batch(seed)
        selection = Selection.parse(select)
        whole = select_pairs(masked_similarity(z, feats), feats, selection)
        chunked = select_pairs_chunked(z, feats, selection, rows=rows)
        assert torch.equal(whole[2], chunked[2])  # the same |H| per head
        assert _chosen_pairs(*whole) == _chosen_pairs(*chunked)


def test_ties_at_the_boundary_go_to_the_smaller_i_then_j():
    # every pair has similarity 1: the top 3 of P are the first three in (i, j) order
    ids = torch.tensor([[CLS, 5, 6, 7, 8, SEP]])
    feats = window_features(ids, torch.ones_like(ids), TOKENS)
    z = torch.zeros(1, 1, 6, 2)
    z[..., 0] = 1.0
    for rows in (1, 2, 3):
        values, index, chosen = select_pairs_chunked(z, feats, Selection.parse("topk:3"), rows=rows)
        assert index[0, 0][chosen[0, 0]].tolist() == [1 * 6 + 2, 1 * 6 + 3, 1 * 6 + 4]
        assert values[0, 0].tolist() == [1.0, 1.0, 1.0]


def test_a_constant_head_breaks_its_ties_like_the_whole_matrix():
    # a constant head: every pair ties; the bound falls inside the ties in every chunk
    feats, z, _attn = _batch(7)
    z = torch.ones_like(z)
    selection = Selection.parse("top:0.1")
    whole = select_pairs(masked_similarity(z, feats), feats, selection)
    for rows in (1, 3, 8):
        chunked = select_pairs_chunked(z, feats, selection, rows=rows)
        assert _chosen_pairs(*whole) == _chosen_pairs(*chunked)


@pytest.mark.parametrize("select", ["top:0.05", "ratio:0.6"])
def test_statistics_are_identical_with_and_without_chunks(select):
    feats, z, attn = _batch(11, n_pos=31, levels=4)
    kwargs = dict(select=Selection.parse(select), gate=2.0, seq_len=31, csm_bin=4)
    whole = head_statistics(z, attn, feats, chunk_rows=31, **kwargs)
    for rows in (1, 4, 13):
        chunked = head_statistics(z, attn, feats, chunk_rows=rows, **kwargs)
        assert whole.keys() == chunked.keys()
        for key in whole:
            assert torch.equal(whole[key], chunked[key]), (key, rows)


def test_chunk_rows_follow_the_budget():
    assert similarity_chunk_rows(32, 12, 128) >= 128  # short windows: one product, as before
    rows = similarity_chunk_rows(1, 9, 4096)
    assert rows < 4096 and rows * 9 * 4096 <= 1 << 24
    assert similarity_chunk_rows(64, 32, 8192, budget=1000) == 1


def test_the_distance_histogram_keeps_every_distance_of_a_long_window():
    # one pair at the largest distance of a 600-position window, selected in row chunks: it is
    # counted at its own distance, 598 (no bins that top out below it)
    n_pos = 600
    ids = torch.full((1, n_pos), 7)
    ids[0, 0], ids[0, -1] = CLS, SEP
    feats = window_features(ids, torch.ones_like(ids), TOKENS)
    z = torch.zeros(1, 1, n_pos, 2)
    z[0, 0, 1:-1, 1] = 0.01 * torch.arange(1, n_pos - 1).remainder(3)  # small, below the pair
    z[0, 0, 1, 0] = z[0, 0, n_pos - 2, 0] = 10.0  # positions 1 and 598: distance 597
    attn = torch.full((1, 1, n_pos, n_pos), 1.0 / n_pos)
    out = head_statistics(z, attn, feats, select=Selection.parse("topk:1"), gate=4.0, seq_len=n_pos, chunk_rows=7)
    assert out["dist_hist"].shape == (1, n_pos)
    assert out["dist_hist"][0].nonzero().flatten().tolist() == [n_pos - 3]


def test_planned_batches_shrink_with_the_window_and_fit_the_memory():
    from headatlas.service.engine.model import plan_batch_size

    gib = 1 << 30
    sizes = [plan_batch_size(16 * gib, n, n_heads=9, d_model=576, ceiling=32) for n in (128, 512, 2048, 4096)]
    assert sizes == [32, 32, 8, 2]  # a 2,048-token window plans 1.1 GiB (9 heads × 8 maps), 4,096: 4.5
    assert plan_batch_size(1 << 20, 8192, n_heads=9, d_model=576, ceiling=32) == 1  # never below one
    assert plan_batch_size(1 << 50, 128, n_heads=12, d_model=768, ceiling=4096) == 4096


def _near_constant_batch(n_pos: int = 60, d: int = 16):
    """Two windows (one padded) of three heads: heads 0 and 2 near-constant (every row the same
    vector up to an ulp or two: float32 cannot rank their top pairs), head 1 ordinary."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 12, (2, n_pos), generator=gen)
    mask = torch.ones(2, n_pos, dtype=torch.long)
    ids[:, 0] = CLS
    ids[0, -1] = SEP
    ids[1, n_pos - 9], ids[1, n_pos - 8 :], mask[1, n_pos - 8 :] = SEP, PAD, 0
    v = torch.randn(d, generator=gen, dtype=torch.float64) * 2.0
    z = torch.randn(2, 3, n_pos, d, generator=gen, dtype=torch.float64)
    for head in (0, 2):
        z[:, head] = v * (1.0 + torch.randn(2, n_pos, d, generator=gen, dtype=torch.float64) * 1.5e-7)
    return window_features(ids, mask, TOKENS), z.float()


@pytest.mark.parametrize("select", ["top:0.02", "topk:5", "ratio:1"])
def test_near_constant_heads_are_reranked_the_same_in_row_chunks(select):
    feats, z = _near_constant_batch()
    selection = Selection.parse(select)
    selected = select_pairs(masked_similarity(z, feats), feats, selection)
    counts = selected[2].long().sum(2)
    unresolved = unresolved_rows(z, selected[0], counts, feats.n_pairs)
    if select != "ratio:1":  # ratio:1 keeps the maximum alone: nothing to rank
        assert unresolved[:, 0].all() and unresolved[:, 2].all() and not unresolved[:, 1].any()
    whole = rerank_unresolved(z, feats, selection, *selected, chunk_rows=z.shape[2])
    for rows in (1, 4, 17):
        chunked = rerank_unresolved(z, feats, selection, *selected, chunk_rows=rows)
        assert torch.equal(whole[2], chunked[2])
        pairs_whole, pairs_chunked = _chosen_pairs(*whole), _chosen_pairs(*chunked)
        assert [p for p, _ in pairs_whole] == [p for p, _ in pairs_chunked]
        for (_, a), (_, b) in zip(pairs_whole, pairs_chunked):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-7, atol=0)


def test_near_constant_heads_in_row_chunks_never_hold_the_whole_matrix():
    n_pos = 300
    feats, z = _near_constant_batch(n_pos=n_pos)
    selection = Selection.parse("top:0.02")
    selected = select_pairs(masked_similarity(z, feats), feats, selection)
    with Largest() as whole:
        rerank_unresolved(z, feats, selection, *selected, chunk_rows=n_pos)
    with Largest() as chunked:
        rerank_unresolved(z, feats, selection, *selected, chunk_rows=8)
    assert whole.numel >= n_pos * n_pos  # the whole path holds pos² per re-ranked head
    # in chunks: at most 8 rows of every re-ranked head, the outputs, the pairs kept
    assert chunked.numel < n_pos * n_pos // 4, chunked.numel


def test_head_statistics_rerank_near_constant_heads_alike_with_and_without_chunks():
    feats, z = _near_constant_batch()
    attn = torch.softmax(torch.randn(2, 3, z.shape[2], z.shape[2], generator=torch.Generator().manual_seed(2)), dim=3)
    kwargs = dict(select=Selection.parse("top:0.02"), gate=2.0, seq_len=z.shape[2])
    whole = head_statistics(z, attn, feats, chunk_rows=z.shape[2], **kwargs)
    for rows in (3, 11):
        chunked = head_statistics(z, attn, feats, chunk_rows=rows, **kwargs)
        for key in whole:
            if key == "sim_sum_high":  # float64 sums of the same float32 values, in another order
                assert torch.allclose(whole[key], chunked[key], rtol=1e-6), key
            elif key == "top_pair_value":  # the same pair's C_ij from a float32 product of another
                # shape: BLAS kernels may round it differently in the last bit (AMD EPYC, 3 rows)
                assert torch.allclose(whole[key], chunked[key], rtol=1e-6, atol=0), (key, rows)
            else:
                assert torch.equal(whole[key], chunked[key]), (key, rows)
