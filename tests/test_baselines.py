"""SPEC §5b baselines: known answers on hand-made windows, through the statistics and through the
database views, and the jackknife interval against a direct computation and by simulation.

Every expected number is worked out by hand in the comments next to it.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
from sqlalchemy import text

from headatlas.service.engine.chance import chance_statistics
from headatlas.service.engine.features import window_features
from headatlas.service.engine.results import (
    CHANCE_SUMS,
    HEAD_SUMS,
    PAIR_HISTS,
    REPLICATES,
    BatchResult,
    replicate_group,
    sum_dtype,
)
from headatlas.service.engine.stats import head_statistics
from headatlas.service.engine.windows import TokenClasses, is_word_token
from headatlas.service.params import Selection
from headatlas.service.reports.intervals import jackknife_halfwidth, t95
from headatlas.service.storage.store import Store

CLS, SEP, PAD, DOT, COMMA, A, B, C, D = 101, 102, 0, 1012, 1010, 1037, 1038, 1039, 1040
TEXT = {CLS: "[CLS]", SEP: "[SEP]", PAD: "[PAD]", DOT: ".", COMMA: ",", A: "a", B: "##b", C: "c", D: "7"}
# word tokens by hand: "a", "##b" (a word piece), "c", "7" (a digit); "." and "," are not
IS_WORD = torch.zeros(1100, dtype=torch.bool)
IS_WORD[[A, B, C, D]] = True
TOKENS = TokenClasses(
    cls_id=CLS,
    sep_id=SEP,
    pad_id=PAD,
    special_ids=frozenset({CLS, SEP, PAD}),
    sentence_end_ids=frozenset({DOT}),
    punct_ids=frozenset({DOT, COMMA}),
    is_word=IS_WORD,
)
SEQ = 8
DIM = 8


def onehot_z(spec: list[tuple[int, float]]) -> torch.Tensor:
    """``[pos, DIM]``: position p gets scale · e_axis, so C_ij = s_i s_j on a shared axis, else 0."""
    z = torch.zeros(len(spec), DIM, dtype=torch.float64)
    for pos, (axis, scale) in enumerate(spec):
        z[pos, axis] = scale
    return z


def uniform_attn(n: int, n_pos: int = SEQ) -> torch.Tensor:
    """Every row (pad rows too) spreads its weight evenly over the n valid keys."""
    a = torch.zeros(n_pos, n_pos, dtype=torch.float64)
    a[:, :n] = 1.0 / n
    return a


# W1, "words": [CLS] a , . a , ##b [SEP]; sentences (. ends the first): a , . | a , ##b
# C: a–a (1,4) = 2·2 = 4, ,–, (2,5) = 2·2 = 4, every other pair 0 → topk:2 picks both, at d = 3.
W1 = [CLS, A, COMMA, DOT, A, COMMA, B, SEP]
Z1 = onehot_z([(5, 1), (1, 2), (2, 2), (3, 1), (1, 2), (2, 2), (4, 1), (6, 1)])
# W2, "frequency tie the other way": [CLS] , a . , a ##b [SEP]; a–a (2,5) = 4, ,–, (1,4) = 1
W2 = [CLS, COMMA, A, DOT, COMMA, A, B, SEP]
Z2 = onehot_z([(5, 1), (2, 1), (1, 2), (3, 1), (2, 1), (1, 2), (4, 1), (6, 1)])
# W3, "distance one": [CLS] a ##b . c 7 [SEP] [PAD]; sentences a ##b . | c 7
# C: (1,2) = 4 and (3,4) = 4, every other pair 0 → topk:2 picks both, both at d = 1.
W3 = [CLS, A, B, DOT, C, D, SEP, PAD]
Z3 = onehot_z([(5, 1), (1, 2), (1, 2), (2, 2), (2, 2), (3, 1), (6, 1), (7, 1)])
# W4, "anchor is not the commonest token": [CLS] , ##b , c , ##b [SEP], no sentence end
# C: b–b (2,6) = 4, b–c (2,4) = 2 and c–b (4,6) = 2 (tie: index order takes (2,4)), commas 0.25
W4 = [CLS, COMMA, B, COMMA, C, COMMA, B, SEP]
Z4 = onehot_z([(5, 1), (2, 0.5), (1, 2), (2, 0.5), (1, 1), (2, 0.5), (1, 2), (6, 1)])


def _feats(windows: list[list[int]], **kw):
    ids = torch.tensor(windows)
    return window_features(ids, (ids != PAD).long(), TOKENS, **kw)


def _heads(windows, zs, attns, feats, select="topk:2", gate=2.0):
    z = torch.stack(zs)[:, None]  # [batch, head=1, pos, d]
    a = torch.stack(attns)[:, None]
    return head_statistics(z, a, feats, select=Selection.parse(select), gate=gate, seq_len=SEQ)


# --- word tokens ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "token, word",
    [
        ("hello", True),
        ("##ing", True),
        ("7", True),
        ("##5", True),
        ("é", True),
        ("Ġthe", True),
        ("▁Über", True),
        ("ß", True),
        ("٣", True),  # Arabic-Indic digit three: Unicode Nd
        (",", False),
        ("##,", False),
        (".", False),
        ('"', False),
        ("'", False),
        ("##", False),
        ("…", False),
        ("Ġ,", False),
        ("▁.", False),
        ("-", False),
        ("$", False),
    ],
)
def test_is_word_token_needs_a_letter_or_digit_after_the_prefix(token, word):
    assert is_word_token(token) is word


def test_word_mask_of_the_real_tokenizer(tiny_model):
    tok = tiny_model.tokenizer
    tokens = TokenClasses.from_tokenizer(tok)
    vocab = tok.get_vocab()
    assert tokens.is_word[vocab["the"]] and tokens.is_word[vocab["##s"]] and tokens.is_word[vocab["1"]]
    assert not tokens.is_word[vocab[","]] and not tokens.is_word[vocab["."]] and not tokens.is_word[vocab['"']]
    # special tokens hold letters ("[CLS]") but are never words
    assert not any(bool(tokens.is_word[i]) for i in tok.all_special_ids)


def byte_level_tokenizer():
    """A byte-level BPE tokenizer by hand (the 256 byte symbols of GPT-2 and seven merges), the
    kind of vocabulary SmolLM2 and GPT-2 have: its strings spell bytes, not text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, **{ch: i + 1 for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}}
    merges = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"), ("Ċ", "Ċ"), ("Ġ", "Ġ"), ("Ã", "©"), ("×", "©")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>")


@pytest.mark.parametrize(
    ("token", "word"),
    [
        ("Ġthe", True),  # " the"
        ("a", True),
        ("7", True),
        ("Ã©", True),  # "é": two bytes of one letter
        ("×©", True),  # "ש": a Hebrew letter, though neither symbol is one
        ("Ċ", False),  # "\n": the newline token (198 in SmolLM2)
        ("ĊĊ", False),  # "\n\n"
        ("Ġ", False),  # " "
        ("ĠĠ", False),  # "  ": a run of spaces, not the letter Ġ after a prefix
        ("Ã", False),  # the first byte of a two-byte character: U+FFFD alone
        ("©", False),  # a continuation byte alone
        (",", False),
    ],
)
def test_byte_level_words_are_judged_on_their_decoded_text(token, word):
    from tests.reference import reference_word_ids

    tok = byte_level_tokenizer()
    idx = tok.convert_tokens_to_ids(token)
    assert bool(TokenClasses.from_tokenizer(tok, specials=(0, None)).is_word[idx]) is word
    assert (idx in reference_word_ids(tok)) is word  # the tests' reference says the same


def test_word_masks_equal_the_reference_over_whole_vocabularies(tiny_model):
    from headatlas.service.engine.windows import word_token_mask
    from tests.reference import reference_word_ids

    for tok in (tiny_model.tokenizer, byte_level_tokenizer()):
        mask = word_token_mask(tok)
        expected = reference_word_ids(tok) - set(tok.all_special_ids)
        assert set(mask.nonzero().flatten().tolist()) == expected


def test_byte_level_runs_have_a_key_of_their_own(tiny_model):
    """The word rule changed for byte-level vocabularies: their run key names it, so that a run
    stored under the old rule is not resumed; every other vocabulary keeps its key."""
    import dataclasses
    import hashlib

    from headatlas.service.engine.run_plan import run_key
    from headatlas.service.params import AnalysisParams

    params = AnalysisParams()

    def old_key(model) -> str:  # the key as computed before the rule changed
        blob = "|".join(["fp", model.spec, model.name, model.tokenizer_key, model.weights_key, params.key()])
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    assert run_key("fp", tiny_model, params) == old_key(tiny_model)
    byte_level = dataclasses.replace(tiny_model, tokenizer=byte_level_tokenizer())
    assert run_key("fp", byte_level, params) != old_key(byte_level)


# --- chance sums of one window ----------------------------------------------------------------------


def test_word_repetition_chance_excludes_punctuation_repeats():
    chance = chance_statistics(_feats([W1]), seq_len=SEQ)
    # P over positions 1..6: 15 pairs; by distance 5 4 3 2 1
    assert int(chance["pairs"]) == 15
    assert chance["hist.pairs"].tolist() == [0, 5, 4, 3, 2, 1, 0, 0]
    # same token: a–a (1,4) and ,–, (2,5), both d = 3; only a–a is a word repeat
    assert int(chance["same_token_pairs"]) == 2
    assert int(chance["same_word_pairs"]) == 1
    assert chance["hist.same_token"].tolist() == [0, 0, 0, 2, 0, 0, 0, 0]
    assert chance["hist.same_word"].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    # sentences {1,2,3} and {4,5,6}: (1,2) (2,3) (4,5) (5,6) at d1, (1,3) (4,6) at d2
    assert int(chance["same_sentence_pairs"]) == 6
    assert chance["hist.same_sentence"].tolist() == [0, 4, 2, 0, 0, 0, 0, 0]
    # valid "." and ",": positions 2, 3, 5
    assert int(chance["punct_tokens"]) == 3


def test_punct_tokens_skip_padding_and_special_tokens():
    # W3: one "." (position 3); [CLS], [SEP] and the pad are not punctuation
    chance = chance_statistics(_feats([W3]), seq_len=SEQ)
    assert int(chance["punct_tokens"]) == 1
    assert int(chance["attn_rows"]) == 7
    assert chance["hist.pairs"].tolist() == [0, 4, 3, 2, 1, 0, 0, 0]  # 5 tokens: 10 pairs
    assert chance["hist.same_sentence"].tolist() == [0, 3, 1, 0, 0, 0, 0, 0]  # (1,2) (2,3) (4,5); (1,3)


# --- per-head sums of one window --------------------------------------------------------------------


def test_same_word_high_counts_word_repeats_not_punctuation_repeats():
    feats = _feats([W1])
    out = _heads([W1], [Z1], [uniform_attn(8)], feats)
    assert int(out["high_pairs"][0]) == 2  # (1,4) a–a and (2,5) ,–,
    assert int(out["same_token_high"][0]) == 2
    assert int(out["same_word_high"][0]) == 1  # only a–a
    assert int(out["same_sentence_high"][0]) == 0  # both cross the "." at 3
    assert out["dist_hist"][0].tolist() == [0, 0, 0, 2, 0, 0, 0, 0]
    # uniform attention: 1/8 < gate 2/8 → nothing attended
    assert out["attended_hist"][0].tolist() == [0] * 8


def test_distance_one_window_attended_hist():
    attn = uniform_attn(7)
    attn[1] = 0.0
    attn[1, 2] = 1.0  # row 1 on key 2: max(A_12, A_21) = 1 ≥ 2/7; (3,4): 1/7 < 2/7
    out = _heads([W3], [Z3], [attn], _feats([W3]))
    assert out["dist_hist"][0].tolist() == [0, 2, 0, 0, 0, 0, 0, 0]
    assert out["attended_hist"][0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]
    assert int(out["same_sentence_high"][0]) == 1  # (1,2); (3,4) = ". c" crosses the sentence end
    assert int(out["same_word_high"][0]) == 0


def test_frequent_token_ties_go_to_the_earliest_first_occurrence():
    feats = _feats([W1, W2, W3, W4, [CLS, SEP, PAD, PAD, PAD, PAD, PAD, PAD]])
    # W1: a ×2 (first at 1), , ×2 (first at 2) → a.   W2: , ×2 (first at 1), a ×2 (at 2) → ,
    # W3: every token once → the first, a.   W4: , ×3 → ,.   A window of specials only: none (-1)
    assert feats.frequent_token.tolist() == [A, COMMA, A, COMMA, -1]
    assert feats.is_word[0].tolist() == [False, True, False, False, True, False, True, False]


def test_frequent_token_ignores_special_and_pad_tokens():
    # three pads outnumber every token; the answer is still the commonest non-special token
    ids = [CLS, B, A, A, SEP, PAD, PAD, PAD]
    feats = _feats([ids])
    assert feats.frequent_token.tolist() == [A]  # a ×2 beats ##b ×1 although ##b comes first


def test_anchor_against_frequency():
    # W1: endpoints a (1, 4) ×2, , (2, 5) ×2 → tie → a, first at 1 = the frequent token
    # W2 with topk:1: H = a–a (2,5) → anchor a ≠ frequent ","
    # W4: H = (2,6) b–b and (2,4) b–c → b ×3 → anchor ##b ≠ frequent ","
    feats = _feats([W1, W2, W4])
    for select, expect_anchor, expect_frequent in [
        ("topk:2", [A, COMMA, B], [True, True, False]),
        ("topk:1", [A, A, B], [True, False, False]),
    ]:
        out = _heads(None, [Z1, Z2, Z4], [uniform_attn(8)] * 3, feats, select=select)
        ids = torch.tensor([W1, W2, W4])
        anchor = ids.gather(1, out["anchor_pos"])[:, 0].tolist()
        assert anchor == expect_anchor, select
        assert [a == f for a, f in zip(anchor, feats.frequent_token.tolist())] == expect_frequent, select
    # (W2 with topk:2: a–a (2,5) = 4 and ,–, (1,4) = 1 → 2 endpoints each, "," first at 1 → ",")
    assert int(out["anchor_count"][2, 0]) == 2  # W4 with topk:1: H = (2,6) → ##b twice


def test_group_sums_equal_each_windows_own_sums():
    # W1 in group 1, W3 in group 0: each group's sums are that window's own, for every sum
    attn1, attn3 = uniform_attn(8), uniform_attn(7)
    attn3[1] = 0.0
    attn3[1, 2] = 1.0
    both = _feats([W1, W3], group=torch.tensor([1, 0]), n_groups=2)
    grouped_chance = chance_statistics(both, seq_len=SEQ)
    grouped = _heads(None, [Z1, Z3], [attn1, attn3], both)
    for g, (w, z, a) in {1: (W1, Z1, attn1), 0: (W3, Z3, attn3)}.items():
        alone = _feats([w])
        own_chance = chance_statistics(alone, seq_len=SEQ)
        own = _heads(None, [z], [a], alone)
        for key in own_chance:
            assert torch.equal(grouped_chance[key][g], own_chance[key]), (g, key)
        for key in [k for k in HEAD_SUMS if k in own] + ["dist_hist", "attended_hist"]:
            assert torch.allclose(grouped[key][g].double(), own[key].double()), (g, key)
    # without groups: the batch total
    total = _heads(None, [Z1, Z3], [attn1, attn3], _feats([W1, W3]))
    assert total["same_word_high"].tolist() == [1]  # W1's a–a; W3 has no repeat
    assert total["dist_hist"][0].tolist() == [0, 2, 0, 2, 0, 0, 0, 0]
    assert total["attended_hist"][0].tolist() == [0, 1, 0, 0, 0, 0, 0, 0]


# --- replicate groups -------------------------------------------------------------------------------


def test_replicate_group_is_a_stable_hash_of_the_window_id():
    # known answers: the first 4 bytes of sha256, big-endian, mod 16, worked out with coreutils
    # (printf '%s' KEY | sha256sum): 762036e1, ba7816bf, 8865fea8
    for wid, expected in [("w0", 1), ("abc", 15), ("0123456789abcdef01234567", 8)]:
        assert replicate_group(wid) == expected
    assert REPLICATES == 16
    groups = Counter(replicate_group(f"window-{k}") for k in range(1600))
    assert set(groups) == set(range(16)) and min(groups.values()) > 60  # roughly even


# --- through the database ---------------------------------------------------------------------------


def ids_in_distinct_groups(count: int, prefix: str = "w") -> list[str]:
    out, seen = [], set()
    k = 0
    while len(out) < count:
        wid, k = f"{prefix}{k}", k + 1
        if replicate_group(wid) not in seen:
            seen.add(replicate_group(wid))
            out.append(wid)
    return out


def build_result(
    window_ids, windows, z, attn, *, select="topk:2", gate=2.0, seq_len=SEQ, tokens=TOKENS, causal=False
) -> BatchResult:
    """A BatchResult from the statistics functions, assembled as service.engine.analysis does it.

    z: ``[window, layer, head, pos, d]``; attn: ``[window, layer, head, pos, key]``."""
    ids = torch.tensor(windows)
    reps, dense = np.unique([replicate_group(w) for w in window_ids], return_inverse=True)
    feats = window_features(
        ids,
        (ids != PAD).long(),
        tokens,
        group=torch.as_tensor(dense.reshape(-1)),
        n_groups=len(reps),
        causal=causal,
    )
    chance = chance_statistics(feats, seq_len=seq_len)
    per_layer = [
        head_statistics(z[:, layer], attn[:, layer], feats, select=Selection.parse(select), gate=gate, seq_len=seq_len)
        for layer in range(z.shape[1])
    ]
    stacked = {k: torch.stack([s[k] for s in per_layer], dim=1) for k in per_layer[0]}
    anchor_pos = stacked["anchor_pos"]
    anchored = stacked["high_count"] > 0
    anchor_token = torch.where(anchored, ids.gather(1, anchor_pos.flatten(1)).view_as(anchor_pos), -1)
    frequent = anchored & (anchor_token == feats.frequent_token[:, None, None])
    stacked["anchor_frequent"] = feats.reduce(frequent.long())
    stacked["anchored_windows"] = feats.reduce(anchored.long())
    n_tokens = (ids != PAD).sum(1).tolist()
    return BatchResult(
        window_ids=list(window_ids),
        reps=reps.astype(np.int16),
        rep_heads={k: stacked[k].numpy() for k in HEAD_SUMS},
        rep_dist_hist=stacked["dist_hist"].numpy().astype(np.int64),
        rep_attended_hist=stacked["attended_hist"].numpy().astype(np.int64),
        rep_chance={k: chance[k].numpy().astype(sum_dtype(k)) for k in CHANCE_SUMS},
        rep_pair_hist={k: chance[f"hist.{k}"].numpy().astype(np.int64) for k in PAIR_HISTS},
        anchor_token=anchor_token.numpy().astype(np.int64),
        anchor_count=stacked["anchor_count"].numpy().astype(np.int32),
        high_count=stacked["high_count"].numpy().astype(np.int32),
        anchor_frequent=frequent.numpy(),
        windows=[
            {"window_id": w, "doc_id": "doc", "window_index": i, "n_tokens": n}
            for i, (w, n) in enumerate(zip(window_ids, n_tokens))
        ],
        documents=[{"doc_id": "doc", "source": "hand", "line": 1, "n_chars": 10, "preview": "hand-made"}],
        vocab={t: TEXT.get(t, str(t)) for t in np.unique(anchor_token.numpy()).tolist() if t >= 0},
    )


def new_run(store: Store, name: str, *, layers: int = 1, heads: int = 1, seq_len: int = SEQ) -> int:
    run, created = store.find_or_create_run(
        run_key=f"key-{name}",
        name=name,
        corpus="hand",
        corpus_fingerprint="fp",
        model={"spec": "hand", "name": "hand", "layers": layers, "heads": heads, "d_head": DIM},
        params={"seq_len": seq_len, "short_range": 4},
        engine="embedded",
        device="cpu",
    )
    assert created
    return run.run_id


def one_row(conn, sql: str, **params) -> dict:
    rows = conn.execute(text(sql), params).mappings().all()
    assert len(rows) == 1, rows
    return dict(rows[0])


@pytest.fixture()
def store(tmp_path) -> Store:
    s = Store(tmp_path / "baselines.duckdb")
    s.ensure_schema()
    return s


def test_batch_result_round_trip_keeps_every_new_field():
    wids = ids_in_distinct_groups(2)
    res = build_result(
        wids, [W1, W4], torch.stack([Z1, Z4])[:, None, None], torch.stack([uniform_attn(8)] * 2)[:, None, None]
    )
    back = BatchResult.from_bytes(res.to_bytes())
    np.testing.assert_array_equal(back.reps, res.reps)
    for k in HEAD_SUMS:
        np.testing.assert_array_equal(back.rep_heads[k], res.rep_heads[k], err_msg=k)
    for k in PAIR_HISTS:
        np.testing.assert_array_equal(back.rep_pair_hist[k], res.rep_pair_hist[k], err_msg=k)
    for k in CHANCE_SUMS:
        np.testing.assert_array_equal(back.rep_chance[k], res.rep_chance[k], err_msg=k)
    np.testing.assert_array_equal(back.rep_attended_hist, res.rep_attended_hist)
    np.testing.assert_array_equal(back.anchor_frequent, res.anchor_frequent)
    # the batch totals: W1 + W4 (see test_views_on_a_two_window_run)
    assert back.chance["same_word_pairs"] == 2 and back.chance["punct_tokens"] == 6
    assert back.heads["same_word_high"].tolist() == [[2]]


def test_distance_matched_chance_of_a_distance_one_head_is_the_same_sentence_rate_at_distance_one(store):
    attn = uniform_attn(7)
    attn[1] = 0.0
    attn[1, 2] = 1.0
    run = new_run(store, "distance-one")
    store.ingest(run, [(0, build_result(["wa"], [W3], Z3[None, None, None], attn[None, None, None]))])
    with store.read() as conn:
        d1 = one_row(conn, "SELECT * FROM pair_profile WHERE run_id = :r AND distance = 1", r=run)
        assert (d1["pairs"], d1["same_sentence_pairs"]) == (4, 3)  # (1,2) (2,3) (4,5) of 4 pairs at d1
        m = one_row(conn, "SELECT * FROM head_metrics WHERE run_id = :r", r=run)
        # both high pairs at d = 1 → Σ_d dist_hist·same/pairs / |H| = 2 · 3/4 / 2 = 3/4
        assert m["within_sentence_chance_dm"] == pytest.approx(d1["same_sentence_pairs"] / d1["pairs"])
        assert m["within_sentence_chance_dm"] == pytest.approx(0.75)
        assert m["within_sentence"] == pytest.approx(0.5)  # (1,2) yes, (3,4) no
        assert m["within_sentence_chance"] == pytest.approx(0.4)  # 4 of 10 pairs share a sentence
        assert m["within_sentence_lift"] == pytest.approx(1.25)
        assert m["within_sentence_lift_dm"] == pytest.approx(2 / 3)  # below 1: the plain lift was locality
        # no repeat anywhere: chance 0 → lifts undefined (NULL), never a division by zero
        assert m["repetition_words"] == 0 and m["repetition_words_chance"] == 0
        assert m["repetition_words_chance_dm"] == 0
        assert m["repetition_words_lift"] is None and m["repetition_words_lift_dm"] is None
        # uniform attention except row 1 (all on key 2): [CLS] gets 1/7 from the 6 other rows
        # → 6/7 over one window; the same for [SEP] and for the single "."
        assert m["attn_to_cls_lift"] == pytest.approx(6 / 7)
        assert m["attn_to_sep_lift"] == pytest.approx(6 / 7)
        assert m["attn_to_punct_lift"] == pytest.approx(6 / 7)
        assert m["anchor_frequency_share"] == pytest.approx(1.0)  # anchor a = the first of all-once tokens
        dist = conn.execute(
            text(
                "SELECT distance, high_pairs, attended_pairs FROM distance_totals WHERE run_id = :r ORDER BY distance"
            ),
            {"r": run},
        ).all()
        assert [tuple(x) for x in dist] == [(1, 2, 1)]
        assert one_row(conn, "SELECT anchor_is_frequent FROM anchors WHERE run_id = :r", r=run)["anchor_is_frequent"]


# Run of W1 and W4 (different replicate groups), topk:2, attention 0.5·uniform + 0.5 on [CLS]:
#   W1: |P| 15, H = (1,4) a–a d3 [token, word], (2,5) ,–, d3 [token]; anchor a = frequent a
#   W4: |P| 15, one sentence, H = (2,6) b–b d4 [sentence, token, word], (2,4) d2 [sentence];
#       anchor ##b ≠ frequent ","
#   pair_hist (both) d1..d5 = 5 4 3 2 1 each → 10 8 6 4 2
#   same_sentence: W1 d1 4, d2 2; W4 all 15 → 9 6 3 2 1 (21 in all)
#   same_token: W1 d3 2; W4 ,–, (1,3) (3,5) d2, (1,5) d4, b–b (2,6) d4 → d2 2, d3 2, d4 2 (6)
#   same_word: W1 d3 1; W4 d4 1 (2)
#   dist_hist: d2 1, d3 2, d4 1 (4 high pairs)
TWO_WINDOW = {
    "within_sentence": 2 / 4,
    "within_sentence_chance": 21 / 30,
    "within_sentence_lift": (2 / 4) / (21 / 30),
    "within_sentence_chance_dm": (1 * 6 / 8 + 2 * 3 / 6 + 1 * 2 / 4) / 4,  # = 9/16
    "within_sentence_lift_dm": (2 / 4) / (9 / 16),
    "repetition": 3 / 4,
    "repetition_chance": 6 / 30,
    "repetition_chance_dm": (1 * 2 / 8 + 2 * 2 / 6 + 1 * 2 / 4) / 4,  # = 17/48
    "repetition_lift_dm": (3 / 4) / (17 / 48),
    "repetition_words": 2 / 4,
    "repetition_words_chance": 2 / 30,
    "repetition_words_lift": (2 / 4) / (2 / 30),
    "repetition_words_chance_dm": (1 * 0 / 8 + 2 * 1 / 6 + 1 * 1 / 4) / 4,  # = 7/48
    "repetition_words_lift_dm": (2 / 4) / (7 / 48),
    "mean_distance": (2 + 2 * 3 + 4) / 4,
    # 8 rows of 0.5/8 + 0.5 on [CLS] per window → 4.5 per window, expected 1 per window
    "attn_to_cls_lift": 4.5,
    "attn_to_sep_lift": 0.5,  # 8 · 0.5/8 per window
    "attn_to_punct_lift": 0.5,  # 8 · 0.5 · 3/8 = 1.5 per window, against 3 "."/"," per window
    "anchor_frequency_share": 1 / 2,
    "noise_share": 1.0,  # 0.5/8 < gate 2/8 off [CLS]; [CLS] is not in P
}


def cls_heavy_attn(n: int) -> torch.Tensor:
    a = 0.5 * uniform_attn(n)
    a[:, 0] += 0.5
    return a


def two_window_run(store: Store) -> tuple[int, list[str]]:
    wids = ids_in_distinct_groups(2)
    run = new_run(store, "two-windows")
    res = build_result(
        wids, [W1, W4], torch.stack([Z1, Z4])[:, None, None], torch.stack([cls_heavy_attn(8)] * 2)[:, None, None]
    )
    store.ingest(run, [(0, res)])
    return run, wids


def test_views_on_a_two_window_run(store):
    run, wids = two_window_run(store)
    with store.read() as conn:
        m = one_row(conn, "SELECT * FROM head_metrics WHERE run_id = :r", r=run)
        for name, value in TWO_WINDOW.items():
            assert m[name] == pytest.approx(value), name
        layer = one_row(conn, "SELECT * FROM layer_metrics WHERE run_id = :r", r=run)
        for name, value in TWO_WINDOW.items():  # one head: the layer is the head
            if name in layer:
                assert layer[name] == pytest.approx(value), name
        profile = conn.execute(
            text(
                "SELECT distance, pairs, same_sentence_pairs, same_token_pairs, same_word_pairs FROM pair_profile "
                "WHERE run_id = :r ORDER BY distance"
            ),
            {"r": run},
        ).all()
        assert [tuple(p) for p in profile] == [
            (1, 10, 9, 0, 0),
            (2, 8, 6, 2, 0),
            (3, 6, 3, 2, 1),
            (4, 4, 2, 2, 1),
            (5, 2, 1, 0, 0),
        ]
        chance = one_row(conn, "SELECT * FROM chance_totals WHERE run_id = :r", r=run)
        assert (chance["same_word_pairs"], chance["punct_tokens"], chance["windows"]) == (2, 6, 2)
        # per replicate group: leaving out one window leaves the other's own sums
        g1, g4 = replicate_group(wids[0]), replicate_group(wids[1])
        loo = {
            r.drop_rep: r
            for r in conn.execute(
                text(
                    "SELECT drop_rep, pairs, same_sentence_pairs, same_token_pairs, same_word_pairs, punct_tokens "
                    "FROM chance_reps WHERE run_id = :r"
                ),
                {"r": run},
            )
        }
        assert set(loo) == {-1, g1, g4}
        assert tuple(loo[g1])[1:] == (15, 15, 4, 1, 3)  # W4 alone
        assert tuple(loo[g4])[1:] == (15, 6, 2, 1, 3)  # W1 alone


def test_jackknife_of_two_groups_by_hand(store):
    from headatlas.service.reports import queries

    run, wids = two_window_run(store)
    g1, g4 = replicate_group(wids[0]), replicate_group(wids[1])
    with store.read() as conn:
        reps = {
            r.drop_rep: r
            for r in conn.execute(
                text(
                    "SELECT drop_rep, within_sentence, repetition_words, anchor_frequency_share FROM head_metrics_reps "
                    "WHERE run_id = :r"
                ),
                {"r": run},
            )
        }
        # without W1: W4 alone, within_sentence 2/2, words 1/2, anchor share 0/1; without W4: W1 alone, 0/2, 1/2, 1/1
        assert (reps[g1].within_sentence, reps[g1].repetition_words, reps[g1].anchor_frequency_share) == (1, 0.5, 0)
        assert (reps[g4].within_sentence, reps[g4].repetition_words, reps[g4].anchor_frequency_share) == (0, 0.5, 1)
        cols, rows = queries.heads(conn, run, ci=True, clip=False)
        _, clipped = queries.heads(conn, run, ci=True)
    row = dict(zip(cols, rows[0]))
    # R = 2, θ_(g) = 1 and 0, θ̄ = 1/2: half = t_{1, 0.975} · sqrt(1/2 · (1/4 + 1/4)) = 12.706 · 0.5
    assert row["within_sentence"] == pytest.approx(0.5)
    assert row["within_sentence_lo"] == pytest.approx(0.5 - 12.7062 * 0.5, abs=1e-4)
    assert row["within_sentence_hi"] == pytest.approx(0.5 + 12.7062 * 0.5, abs=1e-4)
    # both halves give 1/2 → zero width
    assert row["repetition_words_lo"] == pytest.approx(0.5) and row["repetition_words_hi"] == pytest.approx(0.5)
    assert row["anchor_frequency_share_lo"] == pytest.approx(0.5 - 12.7062 * 0.5, abs=1e-4)
    # what a query shows: the same intervals clipped to a share's [0, 1]
    shown = dict(zip(cols, clipped[0]))
    assert (shown["within_sentence_lo"], shown["within_sentence_hi"]) == (0.0, 1.0)
    assert (shown["anchor_frequency_share_lo"], shown["anchor_frequency_share_hi"]) == (0.0, 1.0)
    assert shown["repetition_words_lo"] == pytest.approx(0.5) and shown["repetition_words_hi"] == pytest.approx(0.5)


def test_compaction_keeps_replicate_groups(store):
    run, _ = two_window_run(store)
    query = "SELECT * FROM head_metrics_reps WHERE run_id = :r ORDER BY drop_rep"
    wids2 = ids_in_distinct_groups(2, prefix="second")
    res2 = build_result(
        wids2,
        [W2, W3],
        torch.stack([Z2, Z3])[:, None, None],
        torch.stack([uniform_attn(8), uniform_attn(7)])[:, None, None],
    )
    store.ingest(run, [(1, res2)])
    with store.read() as conn:
        before = [dict(r) for r in conn.execute(text(query), {"r": run}).mappings()]
        pairs_before = conn.execute(text("SELECT * FROM pair_reps WHERE run_id = :r ORDER BY ALL"), {"r": run}).all()
    store.compact(run)
    with store.read() as conn:
        after = [dict(r) for r in conn.execute(text(query), {"r": run}).mappings()]
        pairs_after = conn.execute(text("SELECT * FROM pair_reps WHERE run_id = :r ORDER BY ALL"), {"r": run}).all()
        assert (
            conn.execute(
                text("SELECT count(*) FROM run_chance WHERE run_id = :r AND batch_id >= 0"), {"r": run}
            ).scalar()
            == 0
        )
    assert len(before) == 1 + len({replicate_group(w) for w in ids_in_distinct_groups(2) + wids2})
    assert [r["drop_rep"] for r in after] == [r["drop_rep"] for r in before]
    for b, a in zip(before, after):
        for k in b:
            assert a[k] == pytest.approx(b[k], nan_ok=True), (b["drop_rep"], k)
    assert pairs_after == pairs_before


# --- the jackknife against a direct computation ---------------------------------------------------------


VOCAB = [A, B, C, D, COMMA, DOT]
SYN_SEQ = 16


def synthetic_windows(rng: np.random.Generator, count: int):
    """Random windows: [CLS] + 4..13 tokens (words, "," and ".") + [SEP], padded to SYN_SEQ."""
    windows = []
    for _ in range(count):
        m = int(rng.integers(4, SYN_SEQ - 2))
        body = rng.choice(VOCAB, size=m, p=[0.25, 0.2, 0.15, 0.1, 0.2, 0.1]).tolist()
        windows.append(([CLS, *body, SEP] + [PAD] * SYN_SEQ)[:SYN_SEQ])
    return windows


def per_window_numpy(windows, z, attn, *, select, gate):
    """Each window alone through the statistics (no groups), and the anchor/frequency rule by hand.

    Returns a list of dicts of numpy arrays, one per window."""
    out = []
    for w, ids in enumerate(windows):
        t = torch.tensor([ids])
        feats = window_features(t, (t != PAD).long(), TOKENS)
        chance = chance_statistics(feats, seq_len=SYN_SEQ)
        h = head_statistics(
            z[w : w + 1], attn[w : w + 1], feats, select=Selection.parse(select), gate=gate, seq_len=SYN_SEQ
        )
        rec = {k: float(chance[k]) for k in CHANCE_SUMS}
        rec.update({f"hist.{k}": chance[f"hist.{k}"].numpy().astype(float) for k in PAIR_HISTS})
        for k in (
            "high_pairs",
            "same_sentence_high",
            "same_token_high",
            "same_word_high",
            "attended_high",
            "attn_to_cls",
            "attn_to_punct",
            "attn_to_first",
            "attn_dup",
            "attn_induction",
        ):
            rec[k] = h[k].numpy().astype(float)  # [head]
        rec["dist_hist"] = h["dist_hist"].numpy().astype(float)  # [head, seq]
        # frequent token by hand: most frequent non-special, ties → earliest first occurrence
        body = [x for x in ids if x not in (CLS, SEP, PAD)]
        counts = Counter(body)
        frequent = min(counts, key=lambda tok: (-counts[tok], body.index(tok))) if counts else -1
        anchor = [ids[int(p)] for p in h["anchor_pos"][0]]
        anchored = h["high_count"][0].numpy() > 0
        rec["anchored_windows"] = anchored.astype(float)
        rec["anchor_frequent"] = (anchored & (np.array(anchor) == frequent)).astype(float)
        out.append(rec)
    return out


def metrics_from_sums(s: dict) -> dict[str, np.ndarray]:
    """SPEC §5 / §5b ratios from summed records, per head."""
    pairs_at = s["hist.pairs"]
    share = {
        k: np.divide(s[f"hist.{k}"], pairs_at, out=np.zeros_like(pairs_at), where=pairs_at > 0)
        for k in ("same_sentence", "same_token", "same_word")
    }
    high = s["high_pairs"]
    dist = np.arange(SYN_SEQ)
    ws = s["same_sentence_high"] / high
    ws_dm = (s["dist_hist"] * share["same_sentence"]).sum(1) / high
    words = s["same_word_high"] / high
    words_dm = (s["dist_hist"] * share["same_word"]).sum(1) / high
    return {
        "within_sentence": ws,
        "within_sentence_chance_dm": ws_dm,
        "within_sentence_lift_dm": ws / ws_dm,
        "repetition_words": words,
        "repetition_words_lift": words / (s["same_word_pairs"] / s["pairs"]),
        "repetition_words_lift_dm": words / words_dm,
        "mean_distance": (s["dist_hist"] * dist).sum(1) / high,
        "noise_share": 1 - s["attended_high"] / high,
        "attn_to_cls_lift": s["attn_to_cls"] / s["windows"],
        "attn_to_punct_lift": s["attn_to_punct"] / s["punct_tokens"],
        "anchor_frequency_share": s["anchor_frequent"] / s["anchored_windows"],
        # SPEC §8 (bidirectional: the first token is [CLS], uniform weight 1 per window)
        "attn_to_first_lift": s["attn_to_first"] / s["windows"],
        "attn_dup": s["attn_dup"] / s["dup_rows"],
        "dup_lift": s["attn_dup"] / s["attn_dup_chance"],
        "attn_induction": s["attn_induction"] / s["induction_rows"],
        "induction_lift": s["attn_induction"] / s["attn_induction_chance"],
    }


def total(records) -> dict:
    return {k: sum(r[k] for r in records) for k in records[0]}


def pooled_layer(s: dict, heads: int) -> dict:
    """A layer's sums: its heads' sums added, the run's chance sums once per head (SPEC §5: the
    layer is its heads pooled)."""
    out = {}
    for k, v in s.items():
        if k.startswith("hist."):
            out[k] = v  # per-distance chance shares: the same for every head
        elif k in CHANCE_SUMS:
            out[k] = v * heads
        else:
            out[k] = np.asarray(v).sum(0, keepdims=True)
    return out


def test_jackknife_interval_equals_a_direct_computation(store):
    from headatlas.service.reports import queries

    rng = np.random.default_rng(7)
    n_windows, heads = 60, 2
    windows = synthetic_windows(rng, n_windows)
    wids = [f"syn-{k}" for k in range(n_windows)]
    z = torch.tensor(rng.normal(size=(n_windows, 1, heads, SYN_SEQ, 4)))
    logits = torch.tensor(rng.normal(scale=2.0, size=(n_windows, 1, heads, SYN_SEQ, SYN_SEQ)))
    valid = torch.tensor(windows) != PAD
    logits = logits.masked_fill(~valid[:, None, None, None, :], float("-inf"))
    attn = torch.softmax(logits, dim=-1)
    select, gate = "top:0.2", 2.0
    run = new_run(store, "synthetic", heads=heads, seq_len=SYN_SEQ)
    # three batches; a replicate group spans several batches
    for batch_id, part in enumerate(np.array_split(np.arange(n_windows), 3)):
        part = part.tolist()
        res = build_result(
            [wids[i] for i in part],
            [windows[i] for i in part],
            z[part],
            attn[part],
            select=select,
            gate=gate,
            seq_len=SYN_SEQ,
        )
        store.ingest(run, [(batch_id, res)])

    records = per_window_numpy(windows, z[:, 0], attn[:, 0], select=select, gate=gate)
    groups = np.array([replicate_group(w) for w in wids])
    present = sorted(set(groups.tolist()))
    # 60 windows leave one of the 16 groups empty here: R = the groups that hold windows (15)
    assert len(present) == 15
    whole = metrics_from_sums(total(records))
    loo = {g: metrics_from_sums(total([r for r, gg in zip(records, groups) if gg != g])) for g in present}

    with store.read() as conn:
        rep_rows = conn.execute(text("SELECT * FROM head_metrics_reps WHERE run_id = :r"), {"r": run}).mappings().all()
        cols, rows = queries.heads(conn, run, ci=True)
    by_key = {(r["head"], r["drop_rep"]): r for r in rep_rows}
    assert {k[1] for k in by_key} == {-1, *present}
    out = [dict(zip(cols, r)) for r in rows]
    for name in whole:
        for h in range(heads):
            # θ̂ and every θ_(g) in the view equal the numpy ones from per-window sums
            assert by_key[(h, -1)][name] == pytest.approx(whole[name][h], rel=1e-9), (name, h)
            theta = np.array([loo[g][name][h] for g in present])
            for g, value in zip(present, theta):
                assert by_key[(h, g)][name] == pytest.approx(value, rel=1e-9), (name, h, g)
            r = len(theta)
            estimate = whole[name][h]
            # a lift's interval is the jackknife of ln θ, back-transformed (SPEC §5d); the rest θ̂ ± half
            lift = name == "lift" or name.endswith(("_lift", "_lift_dm"))
            on_log = lift and estimate > 0 and bool((theta > 0).all())
            spread = np.log(theta) if on_log else theta
            dev = spread - spread.mean()
            # R = 15 groups: t_{14, 0.975} = 2.145 (SPEC §5d); a lift's t at the df its kurtosis
            # leaves: 2 / (2/14 + G2⁺/15), G2 the unbiased excess kurtosis of the ln θ_(g), by 0.05
            multiplier = 2.1448
            if on_log:
                g2 = r * (dev**4).sum() / ((dev**2).sum()) ** 2 - 3
                excess = max(0.0, ((r + 1) * g2 + 6) * (r - 1) / ((r - 2) * (r - 3)))
                df = min(r - 1.0, 2 / (2 / (r - 1) + excess / r))
                multiplier = t95(df if df >= r - 1 else max(1.0, math.floor(df / 0.05 + 1e-9) * 0.05))
            half = multiplier * math.sqrt((r - 1) / r * (dev**2).sum())
            assert half > 0, name
            lo, hi = (
                (estimate * math.exp(-half), estimate * math.exp(half))
                if on_log
                else (estimate - half, estimate + half)
            )
            row = next(o for o in out if o["head"] == h)
            assert row[name] == pytest.approx(estimate, rel=1e-9)
            assert row[f"{name}_lo"] == pytest.approx(lo, rel=1e-3), (name, h)
            assert row[f"{name}_hi"] == pytest.approx(hi, rel=1e-3), (name, h)

    # the layer: both heads pooled, whole run and each group left out
    layer_whole = metrics_from_sums(pooled_layer(total(records), heads))
    layer_loo = {
        g: metrics_from_sums(pooled_layer(total([r for r, gg in zip(records, groups) if gg != g]), heads))
        for g in present
    }
    with store.read() as conn:
        layer_rows = {
            r["drop_rep"]: r
            for r in conn.execute(text("SELECT * FROM layer_metrics_reps WHERE run_id = :r"), {"r": run}).mappings()
        }
    assert set(layer_rows) == {-1, *present}
    for name in layer_whole:
        assert layer_rows[-1][name] == pytest.approx(layer_whole[name][0], rel=1e-9), name
        for g in present:
            assert layer_rows[g][name] == pytest.approx(layer_loo[g][name][0], rel=1e-9), (name, g)


def test_jackknife_halfwidth_formula():
    # θ_(g) = 1, 2, 3, 4: θ̄ = 2.5, Σ(θ-θ̄)² = 5, (R-1)/R = 3/4 → sqrt(3.75) · t_{3, 0.975} (3.182)
    assert jackknife_halfwidth([1.0, 2.0, 3.0, 4.0]) == pytest.approx(3.1824 * math.sqrt(3.75), rel=1e-4)
    assert jackknife_halfwidth([1.0, 2.0, 3.0, 4.0], z=1.96) == pytest.approx(1.96 * math.sqrt(3.75))
    assert jackknife_halfwidth([0.3]) is None  # one group: no interval
    assert jackknife_halfwidth([0.3, None]) is None  # an undefined leave-one-out estimate
    assert jackknife_halfwidth([0.3, float("nan")]) is None


def test_jackknife_coverage_by_simulation():
    """Windows of random tokens, each "," with probability p: the share of "," among the
    non-special tokens (punct_tokens / (attn_rows - 2·windows)) has the known value p. About 95%
    of the jackknife intervals (t quantile, SPEC §5d) must contain it, with widths near the true
    standard error. Windows here are independent; tests/test_intervals.py covers clustered corpora."""
    rng = np.random.default_rng(2026)
    p, n_runs, n_windows = 0.15, 400, 160
    # the groups depend on the window ids only: the same grouping as the store
    groups = np.array([replicate_group(f"cov-{k}") for k in range(n_windows)])
    member = np.stack([groups == g for g in range(REPLICATES)])  # [group, window]
    covered, ratio_to_se = 0, []
    for _ in range(n_runs):
        m = rng.integers(10, 126, size=n_windows)  # non-special tokens per window
        hits = rng.binomial(m, p)
        per_group_hits, per_group_m = member @ hits, member @ m
        theta = hits.sum() / m.sum()
        loo = (hits.sum() - per_group_hits) / (m.sum() - per_group_m)
        half = jackknife_halfwidth(loo.tolist())
        r = REPLICATES
        assert half == pytest.approx(2.1314 * math.sqrt((r - 1) / r * ((loo - loo.mean()) ** 2).sum()), rel=1e-4)
        covered += theta - half <= p <= theta + half
        ratio_to_se.append(half / t95(r - 1) / math.sqrt(p * (1 - p) / m.sum()))
    coverage = covered / n_runs
    assert 0.92 <= coverage <= 0.98, coverage
    # a correct jackknife estimates the standard error itself: on average close to the truth
    assert 0.85 <= float(np.mean(ratio_to_se)) <= 1.1, np.mean(ratio_to_se)


# --- runs stored before migration 0006 ------------------------------------------------------------------

# columns that need a sum added by 0006: unavailable (NULL) for a run stored before it
NEW_HEAD_COLUMNS = (
    "within_sentence_chance_dm",
    "within_sentence_lift_dm",
    "repetition_chance_dm",
    "repetition_lift_dm",
    "repetition_words",
    "repetition_words_chance",
    "repetition_words_lift",
    "repetition_words_chance_dm",
    "repetition_words_lift_dm",
    "attn_to_punct_lift",
    "anchor_frequency_share",
)
OLD_HEAD = {  # (batch, head) -> sums, by hand
    (0, 0): dict(
        high_pairs=10,
        sim_sum_all=50.0,
        sim_sum_high=20.0,
        same_sentence_high=4,
        same_token_high=2,
        attended_high=6,
        attn_to_cls=3.0,
        attn_to_sep=1.0,
        attn_to_punct=2.0,
        attn_to_self=1.5,
        attn_to_prev=1.0,
        attn_to_next=0.5,
        attn_entropy=10.0,
    ),
    (0, 1): dict(
        high_pairs=10,
        sim_sum_all=40.0,
        sim_sum_high=30.0,
        same_sentence_high=1,
        same_token_high=5,
        attended_high=9,
        attn_to_cls=6.0,
        attn_to_sep=2.0,
        attn_to_punct=1.0,
        attn_to_self=0.5,
        attn_to_prev=2.0,
        attn_to_next=1.5,
        attn_entropy=12.0,
    ),
    (1, 0): dict(
        high_pairs=6,
        sim_sum_all=25.0,
        sim_sum_high=9.0,
        same_sentence_high=3,
        same_token_high=0,
        attended_high=2,
        attn_to_cls=1.5,
        attn_to_sep=0.5,
        attn_to_punct=1.0,
        attn_to_self=0.5,
        attn_to_prev=0.5,
        attn_to_next=0.5,
        attn_entropy=5.0,
    ),
    (1, 1): dict(
        high_pairs=6,
        sim_sum_all=20.0,
        sim_sum_high=12.0,
        same_sentence_high=0,
        same_token_high=3,
        attended_high=6,
        attn_to_cls=3.0,
        attn_to_sep=1.0,
        attn_to_punct=0.5,
        attn_to_self=0.2,
        attn_to_prev=1.0,
        attn_to_next=0.8,
        attn_entropy=6.0,
    ),
}
OLD_CHANCE = {0: (2, 100, 30, 5, 24), 1: (1, 50, 20, 3, 12)}  # windows, pairs, same_sentence, same_token, rows
OLD_DIST = [(0, 0, 1, 8), (0, 0, 3, 2), (1, 0, 1, 6), (0, 1, 2, 10), (1, 1, 5, 6)]  # batch, head, d, count
# batch, d, count (every distance of a high pair is in P: 100 pairs in batch 0, 50 in batch 1)
OLD_PAIRS = [(0, 1, 30), (0, 2, 40), (0, 3, 20), (0, 4, 10), (1, 1, 20), (1, 2, 15), (1, 3, 10), (1, 4, 3), (1, 5, 2)]


def database_at_0005(path) -> None:
    from alembic import command

    from headatlas.service.storage import db

    engine = db.make_engine(path)
    try:
        with engine.connect() as conn:
            config = db._alembic_config()
            config.attributes["connection"] = conn
            command.upgrade(config, "0005_database_identity")
            conn.commit()
    finally:
        engine.dispose()


def insert_old_run(path) -> int:
    """A finished run as headatlas stored it before 0006: 1 layer, 2 heads, 2 batches, 3 windows."""
    from headatlas.service.storage.db import transaction

    with transaction(path) as conn:
        run = conn.execute(
            text(
                "INSERT INTO runs (run_key, name, corpus, corpus_fingerprint, model, model_name, n_layers, n_heads, "
                "d_head, params, seq_len, short_range, engine, device, status) VALUES ('old-key', 'old', 'hand', 'fp', "
                "'hand', 'hand', 1, 2, 8, '{\"seq_len\": 8, \"short_range\": 4}', 8, 4, 'embedded', 'cpu', 'done') "
                "RETURNING run_id"
            )
        ).scalar()
        for (batch, head), sums in OLD_HEAD.items():
            conn.execute(
                text(
                    f"INSERT INTO head_stats (run_id, batch_id, layer, head, {', '.join(sums)}) "
                    f"VALUES (:r, :b, 0, :h, {', '.join(':' + k for k in sums)})"
                ),
                {"r": run, "b": batch, "h": head, **sums},
            )
        for batch, (w, p, ss, st, rows) in OLD_CHANCE.items():
            conn.execute(
                text("INSERT INTO run_chance VALUES (:r, :b, :w, :p, :ss, :st, :rows)"),
                dict(r=run, b=batch, w=w, p=p, ss=ss, st=st, rows=rows),
            )
            conn.execute(
                text("INSERT INTO batches (run_id, batch_id, n_windows, status) VALUES (:r, :b, :w, 'done')"),
                dict(r=run, b=batch, w=w),
            )
        for batch, head, d, count in OLD_DIST:
            conn.execute(
                text("INSERT INTO dist_hist VALUES (:r, :b, 0, :h, :d, :c)"), dict(r=run, b=batch, h=head, d=d, c=count)
            )
        for batch, d, count in OLD_PAIRS:
            conn.execute(text("INSERT INTO pair_hist VALUES (:r, :b, :d, :c)"), dict(r=run, b=batch, d=d, c=count))
        for k, batch in enumerate([0, 0, 1]):
            conn.execute(text("INSERT INTO run_windows VALUES (:r, :w, :b)"), dict(r=run, w=f"old-{k}", b=batch))
            for head in (0, 1):
                conn.execute(
                    text("INSERT INTO anchors VALUES (:r, :w, 0, :h, :t, 'a', 2, 3, 0.25)"),
                    dict(r=run, w=f"old-{k}", h=head, t=A),
                )
        conn.execute(
            text("INSERT INTO anchor_tokens VALUES (:r, 0, 0, 0, :t, 'a', 3, 0.75), (:r, 0, 0, 1, :t, 'a', 3, 0.75)"),
            dict(r=run, t=A),
        )
        conn.execute(text("INSERT INTO anchor_layers VALUES (:r, 0, 0, 3, 0, 3, 6)"), dict(r=run))
    return run


def view_rows(path, view: str, run: int, order: str) -> list[dict]:
    from headatlas.service.storage.db import transaction

    with transaction(path, read_only=True) as conn:
        return [
            dict(r)
            for r in conn.execute(
                text(f"SELECT * FROM {view} WHERE run_id = :r ORDER BY {order}"), {"r": run}
            ).mappings()
        ]


def assert_same_old_columns(before: list[dict], after: list[dict]) -> None:
    assert len(before) == len(after)
    for b, a in zip(before, after):
        for column, value in b.items():
            assert column in a, column
            assert a[column] == pytest.approx(value, nan_ok=True), column


OLD_VIEWS = {
    "head_metrics": "layer, head",
    "layer_metrics": "layer",
    "chance_totals": "run_id",
    "pair_profile": "distance",
    "distance_totals": "layer, head, distance",
    "anchor_counts": "layer, head",
}


@pytest.fixture()
def old_database(tmp_path):
    path = tmp_path / "old.duckdb"
    database_at_0005(path)
    run = insert_old_run(path)
    before = {view: view_rows(path, view, run, order) for view, order in OLD_VIEWS.items()}
    from headatlas.service.storage import db

    assert db.upgrade(path) == ("0005_database_identity", db.head_revision())
    return path, run, before


def test_old_run_keeps_its_numbers_and_shows_new_columns_as_unavailable(old_database):
    path, run, before = old_database
    # by hand, head 0: within_sentence (4 + 3) / 16; chance (30 + 20) / 150
    assert before["head_metrics"][0]["within_sentence"] == pytest.approx(7 / 16)
    assert before["head_metrics"][0]["within_sentence_chance"] == pytest.approx(1 / 3)
    assert before["head_metrics"][0]["mean_distance"] == pytest.approx((8 * 1 + 2 * 3 + 6 * 1) / 16)
    for view, order in OLD_VIEWS.items():
        assert_same_old_columns(before[view], view_rows(path, view, run, order))
    for view in ("head_metrics", "layer_metrics"):
        for row in view_rows(path, view, run, OLD_VIEWS[view]):
            for column in NEW_HEAD_COLUMNS:
                assert row[column] is None, (view, column, row[column])
    head = view_rows(path, "head_metrics", run, "layer, head")
    # attention to [CLS]/[SEP] against uniform needs only old sums (windows): a right number
    assert head[0]["attn_to_cls_lift"] == pytest.approx((3.0 + 1.5) / 3)
    assert head[1]["attn_to_sep_lift"] == pytest.approx((2.0 + 1.0) / 3)
    chance = view_rows(path, "chance_totals", run, "run_id")[0]
    assert chance["same_word_pairs"] is None and chance["punct_tokens"] is None
    assert all(
        r["same_sentence_pairs"] is None and r["same_token_pairs"] is None and r["same_word_pairs"] is None
        for r in view_rows(path, "pair_profile", run, "distance")
    )
    assert all(r["attended_pairs"] is None for r in view_rows(path, "distance_totals", run, "distance"))
    # no replicate groups: only the whole-run row, and no interval (None, not a number)
    reps = view_rows(path, "head_metrics_reps", run, "layer, head, drop_rep")
    assert {r["drop_rep"] for r in reps} == {-1}
    from headatlas.service.reports import queries
    from headatlas.service.storage.db import transaction

    with transaction(path, read_only=True) as conn:
        cols, rows = queries.heads(conn, run, ci=True)
    for row in rows:
        record = dict(zip(cols, row))
        assert record["within_sentence"] == pytest.approx(7 / 16 if record["head"] == 0 else 1 / 16)
        for column in cols:
            if column.endswith(("_lo", "_hi")):
                assert record[column] is None, column


def test_db_upgrade_of_an_old_database_stores_its_finished_runs_results(old_database, cli):
    """A database from before stored results (schema 0005, a run without replicate groups) gets
    them at `db upgrade`: equal to what the readers compute, its roles in the roles view; then
    the run resumed makes them stale, and the readers compute again."""
    from headatlas.service.storage import run_results
    from tests.test_stored_results import computed, every_result

    path, run, _before = old_database
    with Store(path).checked_read() as conn:
        assert run_results.load(conn, run, "roles") is None  # upgraded by the schema alone: none yet
    done = cli("db", "upgrade", "--db", str(path))
    assert done.returncode == 0, done.stderr
    assert f"results stored for finished run(s) {run}" in done.stdout
    with Store(path).checked_read() as conn:
        assert all(run_results.load(conn, run, k) is not None for k in run_results.KINDS)
        assert every_result(conn, run) == computed(conn, run)
        view = conn.execute(text("SELECT layer, head, role, test FROM roles WHERE run_id = :r"), {"r": run}).all()
    assert len(view) >= 2 and {r[3] for r in view if r[2] != "none established"} <= {"value (no interval)"}
    wids = ids_in_distinct_groups(2, prefix="resumed")
    z = torch.stack([Z1, Z4])[:, None, None].expand(2, 1, 2, SEQ, DIM)
    attn = torch.stack([cls_heavy_attn(8)] * 2)[:, None, None].expand(2, 1, 2, SEQ, SEQ)
    assert Store(path).ingest(run, [(2, build_result(wids, [W1, W4], z, attn))]) == 1
    with Store(path).checked_read() as conn:
        assert run_results.load(conn, run, "heads") is None
        assert every_result(conn, run) == computed(conn, run)
        assert conn.execute(text("SELECT count(*) FROM roles WHERE run_id = :r"), {"r": run}).scalar() == 0


def test_old_run_compacted_or_resumed_after_the_upgrade_never_shows_a_partial_sum(old_database):
    path, run, before = old_database
    store = Store(path)
    store.compact(run)
    for view, order in OLD_VIEWS.items():
        assert_same_old_columns(before[view], view_rows(path, view, run, order))
    # resumed: two new windows stored with every new sum; the old windows still lack them
    wids = ids_in_distinct_groups(2, prefix="resumed")
    z = torch.stack([Z1, Z4])[:, None, None].expand(2, 1, 2, SEQ, DIM)
    attn = torch.stack([cls_heavy_attn(8)] * 2)[:, None, None].expand(2, 1, 2, SEQ, SEQ)
    assert store.ingest(run, [(2, build_result(wids, [W1, W4], z, attn))]) == 1
    for view in ("head_metrics", "layer_metrics"):
        for row in view_rows(path, view, run, OLD_VIEWS[view]):
            for column in NEW_HEAD_COLUMNS:
                assert row[column] is None, (view, column, row[column])
    head = view_rows(path, "head_metrics", run, "layer, head")
    # the old sums go on adding up: 3 + 2 windows; head 0: 16 + 4 high pairs, 7 + 2 in one sentence
    assert [h["windows"] for h in head] == [5, 5]
    assert head[0]["high_pairs"] == 20
    assert head[0]["within_sentence"] == pytest.approx(9 / 20)
    assert view_rows(path, "chance_totals", run, "run_id")[0]["punct_tokens"] is None
    store.compact(run)
    for row in view_rows(path, "head_metrics", run, "layer, head"):
        assert all(row[c] is None for c in NEW_HEAD_COLUMNS)
    assert {r["drop_rep"] for r in view_rows(path, "head_metrics_reps", run, "layer, head")} == {-1}


def test_top_head_of_tied_heads_is_the_lowest(store):
    """`query boundaries`' top_head: heads 1 and 2 see the same vectors, so their within_sentence
    ties exactly (a ratio of counts); the lowest of them is named, on every engine and every run."""
    from headatlas.service.reports import layer_queries

    # W1 = [CLS] a , . a , b [SEP]: head 0 pairs a–a across the "." (Z1); heads 1 and 2 pair ", b"
    # after it, within the second sentence
    within = onehot_z([(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 3), (5, 3), (6, 1)])
    wids = ids_in_distinct_groups(1)
    run = new_run(store, "tied-heads", heads=3)
    z = torch.stack([Z1, within, within])[None, None]  # [window, layer, head, seq, dim]
    attn = torch.stack([uniform_attn(8)] * 3)[None, None]
    store.ingest(run, [(0, build_result(wids, [W1], z, attn))])
    with store.read() as conn:
        per_head = dict(
            conn.execute(text("SELECT head, within_sentence FROM head_metrics WHERE run_id = :r"), {"r": run}).all()
        )
        columns, rows = layer_queries.boundaries(conn, run)
    assert per_head[1] == per_head[2] > per_head[0], per_head
    assert [r[columns.index("top_head")] for r in rows] == [1]
