"""Known answers: the statistics on tiny hand-made tensors, computed by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from headatlas.service.engine.chance import chance_statistics
from headatlas.service.engine.features import sentence_ids, window_features
from headatlas.service.engine.pair_selection import masked_similarity, select_pairs, unresolved_rows
from headatlas.service.engine.stats import head_statistics
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.params import Selection

CLS, SEP, PAD, DOT, COMMA, A, B = 101, 102, 0, 1012, 1010, 1037, 1038
TOKENS = TokenClasses(
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
    special_ids=frozenset({CLS, SEP, PAD}),
    sentence_end_ids=frozenset({DOT}),
    punct_ids=frozenset({DOT, COMMA}),
)

# One window: [CLS] a . a b [SEP]  → sentence ids -1 0 0 1 1 -1
IDS = torch.tensor([[CLS, A, DOT, A, B, SEP]])
MASK = torch.ones_like(IDS)
# Head outputs (d = 2). Pairs among positions 1..4 and their dot products:
# (1,2)=0 (1,3)=2 (1,4)=1 (2,3)=0 (2,4)=1 (3,4)=2 ; sum over P = 6
Z = torch.tensor([[5.0, 5.0], [1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [1.0, 1.0], [9.0, 9.0]], dtype=torch.float64)
# Attention rows (queries), each sums to 1.
ATTN = torch.tensor(
    [
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        [0.1, 0.2, 0.1, 0.5, 0.1, 0.0],
        [0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
        [0.0, 0.0, 0.3, 0.6, 0.1, 0.0],
        [0.0, 0.2, 0.0, 0.4, 0.4, 0.0],
        [0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    ],
    dtype=torch.float64,
)


def _stats(ids, mask, z, attn, select="top:0.5", gate=2.0, heads=1):
    feats = window_features(ids, mask, TOKENS)
    z4 = z[None, None].expand(ids.shape[0], heads, *z.shape).clone()
    a4 = attn[None, None].expand(ids.shape[0], heads, *attn.shape).clone()
    return feats, head_statistics(z4, a4, feats, select=Selection.parse(select), gate=gate, seq_len=8)


def test_sentence_ids_follow_punctuation_and_skip_specials():
    ids = torch.tensor([[CLS, A, B, DOT, A, DOT, B, SEP, PAD, PAD]])
    valid = ids != PAD
    special = (ids == CLS) | (ids == SEP)
    got = sentence_ids(ids, valid, special & valid, frozenset({DOT}))
    assert got.tolist() == [[-1, 0, 0, 0, 1, 1, 2, -1, -1, -1]]


def test_top_share_selects_by_value_then_smaller_i_then_j():
    # top:0.5 of 6 pairs → 3: (1,3)=2, (3,4)=2, then the tie at 1 between (1,4) and (2,4) → (1,4)
    feats, out = _stats(IDS, MASK, Z, ATTN)
    assert int(out["high_pairs"][0]) == 3
    assert float(out["sim_sum_high"][0]) == pytest.approx(5.0)
    assert float(out["sim_sum_all"][0]) == pytest.approx(6.0)
    assert out["dist_hist"][0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]  # d = 2, 1, 3


def test_pair_membership_counts():
    _, out = _stats(IDS, MASK, Z, ATTN)
    assert int(out["same_sentence_high"][0]) == 1  # only (3,4) shares a sentence
    assert int(out["same_token_high"][0]) == 1  # (1,3): a == a
    # gate 2/n = 1/3: (1,3) max(.5, 0) yes; (3,4) max(.1, .4) yes; (1,4) max(.1, .2) no
    assert int(out["attended_high"][0]) == 2


def test_anchor_is_most_frequent_endpoint_token():
    # endpoints 1,3 | 3,4 | 1,4 → token a (positions 1 and 3) 4 times, b twice
    _, out = _stats(IDS, MASK, Z, ATTN)
    assert IDS[0, int(out["anchor_pos"][0, 0])] == A
    assert int(out["anchor_count"][0, 0]) == 4
    assert int(out["high_count"][0, 0]) == 3


def test_attention_sums():
    _, out = _stats(IDS, MASK, Z, ATTN)
    assert float(out["attn_to_cls"][0]) == pytest.approx(1.1)
    assert float(out["attn_to_sep"][0]) == pytest.approx(1.0)
    assert float(out["attn_to_punct"][0]) == pytest.approx(0.1 + 1.0 + 0.3)
    assert float(out["attn_to_self"][0]) == pytest.approx(4.2)
    assert float(out["attn_to_prev"][0]) == pytest.approx(0.1 + 0.0 + 0.3 + 0.4 + 0.0)
    assert float(out["attn_to_next"][0]) == pytest.approx(0.0 + 0.1 + 0.0 + 0.1 + 0.0)
    row1 = -(3 * 0.1 * math.log(0.1) + 0.2 * math.log(0.2) + 0.5 * math.log(0.5))
    row3 = -(0.3 * math.log(0.3) + 0.6 * math.log(0.6) + 0.1 * math.log(0.1))
    row4 = -(0.2 * math.log(0.2) + 2 * 0.4 * math.log(0.4))
    assert float(out["attn_entropy"][0]) == pytest.approx(row1 + row3 + row4)


def test_chance_statistics():
    feats = window_features(IDS, MASK, TOKENS)
    chance = chance_statistics(feats, seq_len=8)
    assert int(chance["pairs"]) == 6
    assert int(chance["same_sentence_pairs"]) == 2  # (1,2) and (3,4)
    assert int(chance["same_token_pairs"]) == 1  # (1,3)
    assert int(chance["attn_rows"]) == 6
    assert chance["hist.pairs"].tolist() == [0, 3, 2, 1, 0, 0, 0, 0]


def test_ratio_and_topk_selection():
    _, ratio = _stats(IDS, MASK, Z, ATTN, select="ratio:0.75")  # C >= 1.5 → (1,3), (3,4)
    assert int(ratio["high_pairs"][0]) == 2
    assert ratio["dist_hist"][0].tolist()[:4] == [0, 1, 1, 0]
    _, topk = _stats(IDS, MASK, Z, ATTN, select="topk:4")  # 2, 2, 1, 1 → (1,3) (3,4) (1,4) (2,4)
    assert int(topk["high_pairs"][0]) == 4
    assert float(topk["sim_sum_high"][0]) == pytest.approx(6.0)


def test_padding_and_batch_do_not_change_a_window():
    # the same window twice, the second padded with two positions of garbage rows
    ids = torch.tensor([[CLS, A, DOT, A, B, SEP, PAD, PAD], [CLS, A, DOT, A, B, SEP, PAD, PAD]])
    mask = (ids != PAD).long()
    z = torch.cat([Z, torch.full((2, 2), 7.0, dtype=torch.float64)])
    attn = torch.zeros(8, 8, dtype=torch.float64)
    attn[:6, :6] = ATTN
    attn[6:, :6] = 1 / 6
    _, out = _stats(ids, mask, z, attn, heads=3)
    assert out["high_pairs"].tolist() == [6, 6, 6]
    assert out["attended_high"].tolist() == [4, 4, 4]
    assert float(out["attn_to_self"][1]) == pytest.approx(8.4)
    assert out["anchor_count"].tolist() == [[4, 4, 4], [4, 4, 4]]


def test_include_special_adds_special_pairs():
    feats = window_features(IDS, MASK, TOKENS, include_special=True)
    assert int(feats.n_pairs[0]) == 15  # n = 6 → 6·5/2


def test_boundary_tie_is_broken_in_index_order():
    # all four words identical vectors → all six pairs tie; top:0.34 → k = ceil(2.04) = 3
    z = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    feats = window_features(IDS, MASK, TOKENS)
    sim = masked_similarity(z[None, None], feats)
    values, index, chosen = select_pairs(sim, feats, Selection.parse("top:0.34"))
    picked = [(int(k) // 6, int(k) % 6) for k, c in zip(index[0, 0], chosen[0, 0]) if c]
    assert picked == [(1, 2), (1, 3), (1, 4)]


# --- SPEC §5b on the same window --------------------------------------------------------------


def test_attended_hist_is_the_gated_part_of_dist_hist():
    # H = (1,3) d2, (3,4) d1, (1,4) d3; the gate passes (1,3) and (3,4) only (see above)
    _, out = _stats(IDS, MASK, Z, ATTN)
    assert out["attended_hist"][0].tolist() == [0, 1, 1, 0, 0, 0, 0, 0]
    # noise profile = dist_hist - attended_hist: only d = 3
    assert (out["dist_hist"][0] - out["attended_hist"][0]).tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


def test_chance_by_distance_and_punct_tokens():
    # positions 1..4 = a . a b, sentences 0 0 1 1: same sentence (1,2) d1, (3,4) d1;
    # same token (1,3) d2; no word tokens in TOKENS (empty is_word table) → no word pairs
    feats = window_features(IDS, MASK, TOKENS)
    chance = chance_statistics(feats, seq_len=8)
    assert chance["hist.same_sentence"].tolist() == [0, 2, 0, 0, 0, 0, 0, 0]
    assert chance["hist.same_token"].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert chance["hist.same_word"].tolist() == [0] * 8
    assert int(chance["same_word_pairs"]) == 0
    assert int(chance["punct_tokens"]) == 1  # the "." at position 2


def test_anchor_tie_goes_to_the_token_seen_first_in_the_window():
    # [CLS] a b , a [SEP]: H = {(2, 4)} (top 1 of 6 pairs, the only positive product), so a (at 4)
    # and b (at 2) are endpoints once each. The rule (SPEC §4): the token whose first occurrence in
    # the window is earliest, whether or not that occurrence is an endpoint: a (first at 1), not b
    # (the earliest endpoint, at 2).
    ids = torch.tensor([[CLS, A, B, COMMA, A, SEP]])
    z = torch.tensor([[5.0, 5.0], [1.0, 0.0], [0.0, 2.0], [0.0, -1.0], [0.0, 2.0], [9.0, 9.0]], dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        _, out = _stats(ids, torch.ones_like(ids), z.to(dtype), ATTN.to(dtype), select="top:0.1", heads=3)
        assert int(out["high_count"][0, 0]) == 1
        assert out["anchor_count"][0].tolist() == [1, 1, 1]
        assert [int(ids[0, p]) for p in out["anchor_pos"][0]] == [A, A, A]


def test_anchor_tie_among_three_tokens_is_decided_by_first_occurrence_alone():
    # [CLS] c b a c b a c [SEP], H = {(2, 4), (3, 5), (6, 7)} (products 4, the rest 0; top 3 of 21):
    # c (at 4, 7), b (at 2, 5) and a (at 3, 6) are endpoints twice each. The anchor is c, first in
    # the window (at 1, not an endpoint); the earliest endpoint (b, at 2) decides nothing.
    C = 1039
    ids = torch.tensor([[CLS, C, B, A, C, B, A, C, SEP]])
    z = torch.zeros(9, 3, dtype=torch.float64)
    z[[2, 4], 0] = 2.0
    z[[3, 5], 1] = 2.0
    z[[6, 7], 2] = 2.0
    _, out = _stats(ids, torch.ones_like(ids), z, torch.eye(9, dtype=torch.float64), select="top:0.1")
    assert int(out["high_count"][0, 0]) == 3
    assert int(out["anchor_count"][0, 0]) == 2
    assert int(ids[0, int(out["anchor_pos"][0, 0])]) == C


def _near_constant_head(n_tok: int = 40, d: int = 64, seed: int = 0) -> torch.Tensor:
    """float32 outputs of a head that sinks its attention on the first token: every row is the
    same vector v up to an ulp or two, so its similarities agree to float32's resolution."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(d, generator=gen, dtype=torch.float64) * 2.0
    wiggle = 1.0 + torch.randn(n_tok, d, generator=gen, dtype=torch.float64) * 1.5e-7
    return (v * wiggle).float()


def _ranked_in_float64(z32: torch.Tensor, pairs: list[tuple[int, int]], k: int) -> list[tuple[int, int]]:
    z = z32.double()
    sim = z @ z.T
    return sorted(pairs, key=lambda p: (-float(sim[p]), p[0], p[1]))[:k]


def test_a_near_constant_head_ranks_its_pairs_at_a_precision_that_separates_them():
    """The top 2% of a near-constant head's similarities lie within float32's rounding of each
    other: ranked in float32, which pairs are high is decided by rounding. The pairs must be the
    ones the exact products of the same float32 outputs rank highest (float64 separates them)."""
    n_tok = 40
    ids = torch.tensor([[CLS, *([A, B, COMMA, DOT] * (n_tok // 4)), SEP]])
    z = torch.zeros(n_tok + 2, 64)
    z[1:-1] = _near_constant_head(n_tok)
    attn = torch.eye(n_tok + 2)
    pairs = [(i, j) for i in range(1, n_tok + 1) for j in range(i + 1, n_tok + 1)]
    k = math.ceil(0.02 * len(pairs))
    expected = _ranked_in_float64(z, pairs, k)
    top = [float(z[i].double() @ z[j].double()) for i, j in expected]
    assert max(top) - min(top) < 4 * torch.finfo(torch.float32).eps * max(top)  # below float32's resolution
    hist = [0] * 48
    for i, j in expected:
        hist[j - i] += 1
    feats = window_features(ids, torch.ones_like(ids), TOKENS)
    out = head_statistics(
        z[None, None], attn[None, None], feats, select=Selection.parse("top:0.02"), gate=2.0, seq_len=48
    )
    assert int(out["high_pairs"][0]) == k
    assert out["dist_hist"][0].tolist() == hist


def test_an_ordinary_float32_head_is_ranked_as_before():
    """A head whose top similarities are far apart keeps its float32 ranking (no re-ranking)."""
    gen = torch.Generator().manual_seed(1)
    n_tok = 40
    ids = torch.tensor([[CLS, *([A, B, COMMA, DOT] * (n_tok // 4)), SEP]])
    z = torch.randn(n_tok + 2, 64, generator=gen)
    feats = window_features(ids, torch.ones_like(ids), TOKENS)
    sim = masked_similarity(z[None, None].clone(), feats)
    values, index, chosen = select_pairs(sim, feats, Selection.parse("top:0.02"))
    assert not unresolved_rows(z[None, None], values, chosen.long().sum(2), feats.n_pairs).any()
    out = head_statistics(
        z[None, None], torch.eye(n_tok + 2)[None, None], feats, select=Selection.parse("top:0.02"), gate=2.0, seq_len=48
    )
    assert float(out["sim_sum_high"][0]) == float(values[chosen].double().sum())
