"""Per-head statistics of the context similarity matrix and the attention map (SPEC §2–4).

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Everything is vectorised over
the batch and the heads; no Python loop runs over tokens or heads.

Dimension names used in shape comments: batch, head, pos (query or key position), key, d_head,
pair (index into the strict upper triangle i < j of a pos × pos matrix, row-major), k (rank
among the selected pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, cast

import torch

from headatlas.service.engine.results import CHANCE_SUMS, HEAD_SUMS  # noqa: F401 - defined torch-free, re-exported
from headatlas.service.engine.windows import TokenClasses
from headatlas.service.params import Selection

if TYPE_CHECKING:
    from headatlas.service.engine.row_attention import AttentionRows


@dataclass(frozen=True)
class PairLayout:
    """Index maps of the strict upper triangle of a pos × pos matrix. All ``[pair]`` int64.

    Only ``i`` and ``j`` are held (pos² int64 each: 268 MB apiece at 8,192 tokens); ``flat`` and
    ``distance`` are made when read, once per batch."""

    i: torch.Tensor
    j: torch.Tensor
    n_pos: int

    @property
    def flat(self) -> torch.Tensor:
        """i * pos + j, into a flattened [pos, pos]."""
        return self.i * self.n_pos + self.j

    @property
    def distance(self) -> torch.Tensor:
        """j - i."""
        return self.j - self.i


# Layouts up to this many positions are kept for reuse (16 lengths); longer ones are made per batch,
# so that a run's long windows of many lengths do not pile up pos² maps in the cache.
CACHED_LAYOUT_POSITIONS = 1024


def pair_layout(n_pos: int, device: torch.device) -> PairLayout:
    if n_pos <= CACHED_LAYOUT_POSITIONS:
        return _cached_layout(n_pos, device)
    return _make_layout(n_pos, device)


def _make_layout(n_pos: int, device: torch.device) -> PairLayout:
    i, j = torch.triu_indices(n_pos, n_pos, offset=1, device=device)
    return PairLayout(i=i, j=j, n_pos=n_pos)


_cached_layout = lru_cache(maxsize=16)(_make_layout)


def sentence_ids(
    input_ids: torch.Tensor, valid: torch.Tensor, special: torch.Tensor, end_ids: frozenset[int]
) -> torch.Tensor:
    """Sentence id per token, ``[batch, pos]`` int64; -1 for special and pad tokens.

    The first non-special token starts sentence 0; a token in ``end_ids`` ends its sentence
    (it belongs to it) and the next token starts a new one (SPEC §1, ``sentences = punct``).
    """
    words = valid & ~special
    ends = torch.zeros_like(words)
    for tok in end_ids:
        ends |= input_ids == tok
    ends &= words
    # sentences completed strictly before each position
    before = torch.cumsum(ends.long(), dim=1) - ends.long()
    return torch.where(words, before, torch.full_like(before, -1))


@dataclass
class WindowFeatures:
    """Per-batch token and pair features, computed once and shared by all layers."""

    input_ids: torch.Tensor  # [batch, pos]
    valid: torch.Tensor  # [batch, pos] bool, non-pad
    n: torch.Tensor  # [batch] valid tokens
    in_pairs: torch.Tensor  # [batch, pos] bool, tokens that form the pair universe P
    pair_ok: torch.Tensor  # [batch, pair] bool, pair in P
    pair_excluded: torch.Tensor  # [batch, pair] bool, not pair_ok
    n_pairs: torch.Tensor  # [batch] |P|
    same_sentence: torch.Tensor  # [batch, pair] bool
    same_token: torch.Tensor  # [batch, pair] bool
    same_word: torch.Tensor  # [batch, pair] bool, same token id and a word token (SPEC §5b)
    is_word: torch.Tensor  # [batch, pos] bool, a word token (SPEC §5b)
    frequent_token: torch.Tensor  # [batch] the window's most frequent non-special token id (-1: none)
    sentence: torch.Tensor  # [batch, pos] sentence id, -1 for special and pad tokens
    first_pos: torch.Tensor  # [batch, pos] first position holding the same token id
    key_classes: torch.Tensor  # [batch, key, 4] bool: is [CLS], is [SEP], is . or ,, is position 0
    visible: torch.Tensor  # [batch, pos] int64: k_i, the keys query row i sees (SPEC §8)
    copies: torch.Tensor  # [batch, pos, key, 2] bool: key in D(i), key in I(i) (SPEC §8)
    copy_index: torch.Tensor  # [batch, copy] int64: i·pos + key of the (row, key) entries of D or I
    copy_kind: torch.Tensor  # [batch, copy, 2] bool: the entry is in D(i), in I(i) (padding: neither)
    layout: PairLayout
    workspace: Workspace
    causal: bool = False
    group: torch.Tensor | None = None  # [batch] replicate group (dense index); None: sum the batch
    n_groups: int = 1
    _bias: dict = field(default_factory=dict)
    _copy_weights: dict = field(default_factory=dict)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Per-window values ``[batch, ...]`` → ``[group, ...]`` sums, or ``[...]`` without groups."""
        if self.group is None:
            return x.sum(0)
        out = torch.zeros((self.n_groups, *x.shape[1:]), dtype=x.dtype, device=x.device)
        return out.index_add_(0, self.group, x)

    def pair_bias(self, heads: int, dtype: torch.dtype) -> torch.Tensor:
        """``[batch·head, pos, pos]``: 0 where (i, j) is in P (i < j), -inf elsewhere.

        Built once per batch and shared by its layers.
        """
        key = (heads, dtype)
        if key not in self._bias:
            batch, n_pos = self.valid.shape
            bias = torch.full((batch, n_pos * n_pos), float("-inf"), dtype=dtype, device=self.valid.device)
            bias[:, self.layout.flat] = torch.where(self.pair_ok, 0.0, float("-inf")).to(dtype)
            self._bias.clear()
            self._bias[key] = (
                bias.view(batch, 1, n_pos, n_pos)
                .expand(batch, heads, n_pos, n_pos)
                .reshape(batch * heads, n_pos, n_pos)
            )
        return self._bias[key]

    def copy_weights(self, dtype: torch.dtype) -> torch.Tensor:
        """``copy_kind`` in ``dtype``, made once per batch and shared by its layers."""
        if dtype not in self._copy_weights:
            self._copy_weights.clear()
            self._copy_weights[dtype] = self.copy_kind.to(dtype)
        return self._copy_weights[dtype]


def window_features(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    tokens: TokenClasses,
    *,
    include_special: bool = False,
    workspace: Workspace | None = None,
    group: torch.Tensor | None = None,
    n_groups: int = 1,
    sentence: torch.Tensor | None = None,  # [batch, pos] int64 from the windows (segmenter); None: punct
    causal: bool = False,
) -> WindowFeatures:
    """Token features for a padded batch. ``input_ids``/``attention_mask``: ``[batch, pos]``.

    ``causal``: the model's attention is causal (a decoder): query row i sees the keys up to i,
    ``k_i = i + 1``; otherwise every valid key, ``k_i = n`` (SPEC §8).

    ``workspace``: scratch buffers to reuse (pass the same one for every batch of a process).
    ``group``: ``[batch]`` replicate group of each window, dense in ``[0, n_groups)``: the sums
    are then kept per group (``[group, ...]``); without it they are batch totals.
    """
    device = input_ids.device
    n_pos = input_ids.shape[1]
    valid = attention_mask.bool()
    special = torch.zeros_like(valid)
    for tok in tokens.special_ids:
        special |= input_ids == tok
    special &= valid
    in_pairs = valid if include_special else valid & ~special
    layout = pair_layout(n_pos, device)
    pair_ok = in_pairs[:, layout.i] & in_pairs[:, layout.j]  # [batch, pair]
    sent = sentence_ids(input_ids, valid, special, tokens.sentence_end_ids) if sentence is None else sentence
    # compared per pair as int32 (sentence and token ids are far below 2^31): half the memory of
    # int64 gathers, which a long window's pos²/2 pairs make large (268 MB each at 8,192 tokens)
    sent32 = sent.to(torch.int32)
    si, sj = sent32[:, layout.i], sent32[:, layout.j]
    same_sentence = pair_ok & (si == sj) & (si >= 0)
    del si, sj
    ids32 = input_ids.to(torch.int32)
    same_token = pair_ok & (ids32[:, layout.i] == ids32[:, layout.j])
    is_word = _lookup(tokens.is_word, input_ids) & valid & ~special
    same_word = same_token & is_word[:, layout.i]
    # first occurrence of each position's token id within its window: argmax returns the
    # first maximal index, i.e. the earliest equal token.
    eq = (input_ids[:, :, None] == input_ids[:, None, :]) & valid[:, None, :]  # [batch, pos, key]
    first_pos = eq.to(torch.uint8).argmax(dim=2)
    # the most frequent non-special token: occurrences per position, -1 off the candidates;
    # argmax takes the first maximal position, i.e. the earliest first occurrence on ties
    candidates = valid & ~special
    occurrences = (eq & candidates[:, None, :]).view(torch.uint8).sum(2, dtype=torch.int32)
    occurrences = torch.where(candidates, occurrences, -1)
    frequent_pos = occurrences.argmax(dim=1, keepdim=True)  # [batch, 1]
    frequent_token = torch.where(candidates.any(1), input_ids.gather(1, frequent_pos).squeeze(1), -1)
    is_cls = (input_ids == tokens.cls_id) & valid
    is_sep = (input_ids == tokens.sep_id) & valid
    is_punct = torch.zeros_like(valid)
    for tok in tokens.punct_ids:
        is_punct |= input_ids == tok
    is_punct &= valid
    is_first = valid & (torch.arange(n_pos, device=device) == 0)
    key_classes = torch.stack([is_cls, is_sep, is_punct, is_first], dim=2)
    m = in_pairs.sum(1)
    n = valid.sum(1)
    dup, induction = copy_sets(eq, candidates)
    copy_index, copy_kind = copy_entries(dup, induction)
    # k_i: valid keys up to i (i + 1 in a right-padded window) or all n of them
    visible = torch.cumsum(valid.long(), dim=1) if causal else n[:, None].expand(-1, n_pos)
    return WindowFeatures(
        input_ids=input_ids,
        valid=valid,
        n=n,
        in_pairs=in_pairs,
        pair_ok=pair_ok,
        pair_excluded=~pair_ok,
        n_pairs=m * (m - 1) // 2,
        same_sentence=same_sentence,
        same_token=same_token,
        same_word=same_word,
        is_word=is_word,
        frequent_token=frequent_token,
        sentence=sent,
        first_pos=first_pos,
        key_classes=key_classes,
        visible=visible,
        copies=torch.stack([dup, induction], dim=3),
        copy_index=copy_index,
        copy_kind=copy_kind,
        layout=layout,
        workspace=workspace if workspace is not None else Workspace(device),
        group=group,
        n_groups=n_groups,
        causal=causal,
    )


def copy_sets(eq: torch.Tensor, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The earlier copies D(i) and the induction targets I(i) of each query row (SPEC §8), each
    ``[batch, pos, key]`` bool.

    eq: ``[batch, pos, key]`` equal token ids (valid keys); words: ``[batch, pos]`` valid
    non-special tokens. Rows are the words; D(i) = {k < i : t_k = t_i, k a word};
    I(i) = {k + 1 : k < i − 1, t_k = t_i, k a word}: D's mask with k < i − 1, shifted one key
    to the right. Both lie before i, so they are visible to causal and bidirectional rows alike.
    """
    n_pos = eq.shape[1]
    same = eq & words[:, :, None] & words[:, None, :]  # [batch, pos, key]
    before = torch.ones(n_pos, n_pos, dtype=torch.bool, device=eq.device)
    dup = same & before.tril(-1)  # k < i
    induction = torch.zeros_like(dup)
    induction[:, :, 1:] = (same & before.tril(-2))[:, :, :-1]  # key k + 1 for k < i - 1
    return dup, induction


def copy_entries(dup: torch.Tensor, induction: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, key) entries of D or I per window, packed: ``index`` ``[batch, copy]`` (i·pos +
    key) and ``kind`` ``[batch, copy, 2]`` bool (in D, in I); windows with fewer entries are padded
    with entry 0 of neither kind. Built from ``nonzero`` (row-major, so each window's entries are
    consecutive): no sort over the pos² entries."""
    batch, device = dup.shape[0], dup.device
    either = (dup | induction).flatten(1)  # [batch, pos·key]
    window, flat = either.nonzero(as_tuple=True)
    counts = torch.bincount(window, minlength=batch)
    width = int(counts.max()) if window.numel() else 0
    slot = torch.arange(window.numel(), device=device) - (torch.cumsum(counts, 0) - counts)[window]
    index = torch.zeros(batch, width, dtype=torch.long, device=device)
    index[window, slot] = flat
    kind = torch.zeros(batch, width, 2, dtype=torch.bool, device=device)
    kind[window, slot, 0] = dup.flatten(1)[window, flat]
    kind[window, slot, 1] = induction.flatten(1)[window, flat]
    return index, kind


def _lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[ids]`` for a per-vocabulary flag; ids beyond the table read False."""
    if table.numel() == 0:
        return torch.zeros_like(ids, dtype=torch.bool)
    table = table.to(ids.device)
    return torch.where(ids < table.numel(), table[ids.clamp(max=table.numel() - 1)], False)


def chance_statistics(feats: WindowFeatures, *, seq_len: int) -> dict[str, torch.Tensor]:
    """Head-independent sums: the chance numerators of SPEC §5 and §5b.

    Returns, per replicate group (``[group]``; scalars without groups), the sums of CHANCE_SUMS
    (int64 counts, float64 uniform weights of SPEC §8), and the per-distance counts PAIR_HISTS
    (``pairs`` = ``pair_hist``) ``[group, seq_len]`` (index = distance).
    """
    pair_ok = feats.pair_ok
    batch = pair_ok.shape[0]
    distance = feats.layout.distance.expand(batch, -1)  # [batch, pair]

    def by_distance(mask: torch.Tensor) -> torch.Tensor:
        hist = torch.zeros(batch, seq_len, dtype=torch.long, device=mask.device)
        return feats.reduce(hist.scatter_add_(1, distance, mask.long()))

    reduce = feats.reduce
    valid, classes = feats.valid, feats.key_classes
    # |S ∩ visible(i)| per row i: keys of S up to i (causal) or all of them
    seen = (
        torch.cumsum(classes.long(), dim=1) if feats.causal else classes.long().sum(1, keepdim=True).expand_as(classes)
    )
    copies = feats.copies.sum(2)  # [batch, pos, 2]: |D(i)|, |I(i)|
    next_rows = torch.zeros_like(feats.n) if feats.causal else _count(valid[:, 1:] & valid[:, :-1], dim=1)
    return {
        "windows": reduce(torch.ones(batch, dtype=torch.long, device=pair_ok.device)),
        "pairs": reduce(feats.n_pairs),
        "same_sentence_pairs": reduce(_count(feats.same_sentence, dim=1)),
        "same_token_pairs": reduce(_count(feats.same_token, dim=1)),
        "attn_rows": reduce(feats.n),
        "same_word_pairs": reduce(_count(feats.same_word, dim=1)),
        "punct_tokens": reduce(_count(feats.key_classes[:, :, 2], dim=1)),
        # SPEC §8: uniform attention over each row's visible keys, summed over valid rows
        "uniform_cls": reduce(uniform_weight(seen[..., 0], feats)),
        "uniform_sep": reduce(uniform_weight(seen[..., 1], feats)),
        "uniform_punct": reduce(uniform_weight(seen[..., 2], feats)),
        "uniform_first": reduce(uniform_weight(seen[..., 3], feats)),
        "next_rows": reduce(next_rows),
        "dup_rows": reduce(_count(copies[..., 0] > 0, dim=1)),
        "attn_dup_chance": reduce(uniform_weight(copies[..., 0], feats)),
        "induction_rows": reduce(_count(copies[..., 1] > 0, dim=1)),
        "attn_induction_chance": reduce(uniform_weight(copies[..., 1], feats)),
        "hist.pairs": by_distance(pair_ok),
        "hist.same_sentence": by_distance(feats.same_sentence),
        "hist.same_token": by_distance(feats.same_token),
        "hist.same_word": by_distance(feats.same_word),
    }


def uniform_weight(seen: torch.Tensor, feats: WindowFeatures) -> torch.Tensor:
    """Σ over valid query rows of |S ∩ visible(i)| / k_i, the weight uniform attention puts on
    a key set S, per window ``[batch]`` float64. ``seen``: ``[batch, pos]`` |S ∩ visible(i)|.

    Bidirectional rows share k_i = n, so the sum is Σ_i |S ∩ visible(i)| / n: one division, which
    gives a whole number exactly where there is one (one [CLS] per window: 1.0)."""
    seen = torch.where(feats.valid, seen, 0)
    if feats.causal:
        return (seen.double() / feats.visible.clamp(min=1).double()).sum(1)
    return seen.sum(1).double() / feats.n.clamp(min=1).double()


def head_vectors(context: torch.Tensor, n_heads: int, w_o: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head output vectors from the self-attention context layer.

    context: ``[batch, pos, head·d_head]`` (before W_O). Returns ``[batch, head, pos, d_head]``,
    or ``[batch, head, pos, d_model]`` when ``w_o`` (``[d_model, head·d_head]``, the dense
    weight of the attention output) is given: ``z_i W_O^h`` without bias (SPEC §2, post_wo).
    """
    batch, n_pos, width = context.shape
    context = _at_least_float32(context)  # half-precision forward, float32 statistics
    z = context.view(batch, n_pos, n_heads, width // n_heads).transpose(1, 2)
    if w_o is None:
        return z
    w = w_o.view(w_o.shape[0], n_heads, width // n_heads).permute(1, 2, 0)  # [head, d_head, d_model]
    return torch.matmul(z, w.to(z.dtype))


def masked_similarity(z: torch.Tensor, feats: WindowFeatures) -> torch.Tensor:
    """The context similarity matrix C = z zᵀ with every entry outside P set to -inf.

    z: ``[batch, head, pos, d]``. Returns ``[batch, head, pos·pos]`` (row-major: index
    i·pos + j), in a scratch buffer of ``feats.workspace``: one fused ``baddbmm`` adds the
    mask, which is cheaper than gathering the upper triangle and masking it.
    """
    batch, heads, n_pos, d = z.shape
    out = feats.workspace.buffer("sim", (batch * heads, n_pos, n_pos), z.dtype)
    flat_z = z.reshape(batch * heads, n_pos, d)
    torch.baddbmm(feats.pair_bias(heads, z.dtype), flat_z, flat_z.transpose(1, 2), out=out)
    return out.view(batch, heads, n_pos * n_pos)


def select_pairs(
    sim: torch.Tensor, feats: WindowFeatures, select: Selection
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The high-similarity set H per (window, head), as ranked pair indices.

    sim: ``[batch, head, pos·pos]`` from ``masked_similarity`` (-inf outside P). Returns
    ``values``, ``index`` (i·pos + j) and ``chosen`` (bool), each ``[batch, head, k]``;
    ``chosen`` marks the first ``|H|`` ranks. Ties at the boundary go to the smaller i, then
    the smaller j (SPEC §3): row-major index order is (i, j) order.
    """
    batch, heads, width = sim.shape
    if select.kind == "ratio":
        top = sim.amax(dim=2, keepdim=True)  # [batch, head, 1]
        chosen_mask = (sim >= select.value * top) & (sim > float("-inf"))
        counts = _count(chosen_mask, dim=2)  # [batch, head]
    else:
        per_window = torch.tensor([select.count(int(p)) for p in feats.n_pairs.tolist()], device=sim.device)
        counts = per_window[:, None].expand(batch, heads)
    k_max = int(counts.max()) if counts.numel() else 0
    if k_max == 0:
        empty = sim.new_zeros((batch, heads, 0))
        return empty, empty.long(), empty.bool()
    # one extra rank shows whether the boundary value is tied
    values, index = torch.topk(sim, min(k_max + 1, width), dim=2, sorted=True)
    ranks = torch.arange(values.shape[2], device=sim.device)
    if select.kind != "ratio" and values.shape[2] > k_max:
        at = (counts - 1).clamp(min=0)[..., None]
        last = values.gather(2, at)
        after = values.gather(2, counts[..., None].clamp(max=values.shape[2] - 1))
        tied = (last == after).squeeze(2) & (counts > 0) & (counts < feats.n_pairs[:, None])
        if bool(tied.any()):
            values, index = _resolve_ties(sim, values, index, tied)
    values, index = values[..., :k_max], index[..., :k_max]
    chosen = ranks[:k_max] < counts[..., None]
    return values, index, chosen


# A (window, head) whose similarities from its top one to the first one left out of H lie within
# UNRESOLVED_ULPS · d float32 units of the top's magnitude has no high set that float32 can tell
# apart: dot products of d terms are rounded by up to about d units, more than the spread. Heads
# that sink almost all attention on the first token give such near-constant z (top 2% within
# 2e-8 of each other). Ordinary heads' top 2% spread over a sizeable fraction of their magnitude.
UNRESOLVED_ULPS = 4


def unresolved_rows(z: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, n_pairs: torch.Tensor) -> torch.Tensor:
    """``[batch, head]`` bool: the rows whose ranking float32 cannot decide (``UNRESOLVED_ULPS``):
    ``values`` ``[batch, head, k]`` ranked similarities, ``counts`` ``[batch, head]`` |H| per row,
    ``n_pairs`` ``[batch]``. Always False for float64 outputs and where H is all of P."""
    if z.dtype == torch.float64 or values.shape[2] == 0:
        return torch.zeros(values.shape[:2], dtype=torch.bool, device=values.device)
    boundary = values.gather(2, counts.clamp(max=values.shape[2] - 1)[..., None]).squeeze(2).double()
    top = values[..., 0].double()
    magnitude = torch.maximum(top.abs(), boundary.abs())
    tolerance = UNRESOLVED_ULPS * z.shape[-1] * torch.finfo(torch.float32).eps * magnitude
    partial = (counts > 0) & (counts < n_pairs[:, None]) & torch.isfinite(boundary)
    return partial & (top - boundary <= tolerance)


def rerank_unresolved(
    z: torch.Tensor,
    feats: WindowFeatures,
    select: Selection,
    values: torch.Tensor,
    index: torch.Tensor,
    chosen: torch.Tensor,
    *,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_pairs``'s result with the rows that float32 cannot rank (``unresolved_rows``: a
    near-constant head) ranked again on float64 products of the same outputs, which separate
    them; every other row as it was. Returns (values, index, chosen), padded to a common k.

    The re-ranked rows' float64 matrices are taken whole while they fit in ``SIM_CHUNK_ELEMENTS``
    (as float32 entries: half as many float64 ones), in row chunks beyond (``select_pairs_chunked``,
    the same pairs under the same tie rule), so a long window's near-constant heads hold
    pos · rows float64 entries each, not pos². ``chunk_rows`` forces the rows per chunk (tests)."""
    counts = chosen.long().sum(2)
    rows = unresolved_rows(z, values, counts, feats.n_pairs)
    if not bool(rows.any()):
        return values, index, chosen
    b_idx, h_idx = rows.nonzero(as_tuple=True)
    n_pos = z.shape[2]
    sub = z[b_idx, h_idx].double()  # [m, pos, d]
    # the rows' own windows: what the selection reads of the features (n_pairs, in_pairs)
    row_feats = cast(WindowFeatures, _RowPairs(feats.n_pairs[b_idx], feats.in_pairs[b_idx]))
    if chunk_rows is None:
        chunk_rows = similarity_chunk_rows(len(b_idx), 1, n_pos, budget=SIM_CHUNK_ELEMENTS // 2)
    if chunk_rows < n_pos:
        v64, i64, c64 = select_pairs_chunked(sub[:, None], row_feats, select, rows=max(1, chunk_rows))
    else:
        bias = torch.full((len(b_idx), n_pos * n_pos), float("-inf"), dtype=torch.float64, device=z.device)
        bias[:, feats.layout.flat] = torch.where(feats.pair_ok[b_idx], 0.0, float("-inf")).double()
        sim = torch.baddbmm(bias.view(-1, n_pos, n_pos), sub, sub.transpose(1, 2)).view(len(b_idx), 1, -1)
        v64, i64, c64 = select_pairs(sim, row_feats, select)
    width = max(values.shape[2], v64.shape[2])

    def pad(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[2]), value=fill) if t.shape[2] < width else t

    values, index, chosen = pad(values, float("-inf")), pad(index, 0), pad(chosen, False)
    values[b_idx, h_idx] = pad(v64, float("-inf"))[:, 0].to(values.dtype)
    index[b_idx, h_idx] = pad(i64, 0)[:, 0]
    chosen[b_idx, h_idx] = pad(c64, False)[:, 0]
    return values, index, chosen


@dataclass
class _RowPairs:
    """What ``select_pairs`` and ``select_pairs_chunked`` read of a window's features, for rows
    picked from several windows: ``[row]`` |P| and ``[row, pos]`` the tokens that form P."""

    n_pairs: torch.Tensor
    in_pairs: torch.Tensor


def _resolve_ties(sim, values, index, tied):
    """Re-rank the rows whose boundary is tied with a stable sort (index order = (i, j) order)."""
    rows = tied.nonzero(as_tuple=True)
    width = values.shape[2]
    sorted_vals, order = torch.sort(sim[rows], dim=1, descending=True, stable=True)
    values, index = values.clone(), index.clone()
    values[rows] = sorted_vals[:, :width]
    index[rows] = order[:, :width]
    return values, index


# Entries of the similarity matrix held at once per batch (all heads), 64 MiB in float32: below it
# the whole matrix is computed in one product (short windows, as before); above it, in row chunks.
SIM_CHUNK_ELEMENTS = 1 << 24


def similarity_chunk_rows(batch: int, heads: int, n_pos: int, budget: int | None = None) -> int:
    """Rows of the similarity matrix per chunk so that a chunk of every head of the batch holds
    at most ``budget`` entries (default: ``SIM_CHUNK_ELEMENTS``, read at each call so that a
    benchmark can switch chunking off) and at least one row; ``n_pos`` or more: no chunking needed."""
    budget = SIM_CHUNK_ELEMENTS if budget is None else budget
    return max(1, budget // max(1, batch * heads * n_pos))


def _similarity_rows(z: torch.Tensor, in_pairs: torch.Tensor, rows: int):
    """The masked similarity matrix in chunks of rows: yields ``(first, sim)``, ``sim``
    ``[batch, head, r, pos − first − 1]``: rows ``first .. first + r − 1``, columns
    ``first + 1 ..`` (only those can hold pairs i < j of the chunk), -inf outside P.
    Each entry is the same product as in ``masked_similarity``. ``in_pairs``: ``[batch, pos]``
    (``WindowFeatures.in_pairs``)."""
    n_pos = z.shape[2]
    cols = torch.arange(n_pos, device=z.device)
    for first in range(0, n_pos - 1, rows):
        last = min(first + rows, n_pos - 1)
        right = z[:, :, first + 1 :]  # [batch, head, pos - first - 1, d]
        sim = torch.matmul(z[:, :, first:last], right.transpose(2, 3))
        upper = cols[first + 1 :][None, :] > cols[first:last][:, None]  # [r, cols], j > i
        ok = in_pairs[:, first:last, None] & in_pairs[:, None, first + 1 :] & upper
        yield first, sim.masked_fill_(~ok[:, None], float("-inf"))


def select_pairs_chunked(
    z: torch.Tensor, feats: WindowFeatures, select: Selection, *, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``select_pairs(masked_similarity(z, feats), feats, select)`` without the whole matrix:
    the same ``values``, ``index`` and ``chosen`` ranks (the same pairs, in the same order up to
    the order of equal values), with ``rows`` rows of the matrix held at a time, so a window's
    memory grows with pos · rows per head, not pos² (plus the k ranks kept).

    ``top:``/``topk:``: one pass keeps a running top k + 1 of the chunks (values and pair
    indices), k the batch's largest |H|. Where a head's boundary is tied (rank |H| and the next
    hold equal values, as ``select_pairs`` checks), a second pass takes every pair above the
    boundary value and the pairs equal to it in (i, j) order — the tie rule of SPEC §3 — for
    the whole batch. ``ratio:``: the maximum, the count at or above its share, then the pairs.
    """
    batch, heads, n_pos, _ = z.shape
    if select.kind == "ratio":
        top = torch.full((batch, heads), float("-inf"), device=z.device, dtype=z.dtype)
        for _first, sim in _similarity_rows(z, feats.in_pairs, rows):
            top = torch.maximum(top, sim.flatten(2).amax(2))
        threshold = select.value * top  # [batch, head]
        counts = torch.zeros(batch, heads, dtype=torch.long, device=z.device)
        for _first, sim in _similarity_rows(z, feats.in_pairs, rows):
            flat = sim.flatten(2)
            counts += _count((flat >= threshold[..., None]) & (flat > float("-inf")), dim=2)
    else:
        per_window = torch.tensor([select.count(int(p)) for p in feats.n_pairs.tolist()], device=z.device)
        counts = per_window[:, None].expand(batch, heads)
    k = int(counts.max()) if counts.numel() else 0
    if k == 0:
        empty = z.new_zeros((batch, heads, 0))
        return empty, empty.long(), empty.bool()
    chosen = torch.arange(k, device=z.device) < counts[..., None]
    if select.kind == "ratio":
        # every pair at or above the threshold (at most k per head), none by rank
        values, index = _collect_pairs(z, feats.in_pairs, rows, k, threshold, None)
        return values.view(batch, heads, k), index.view(batch, heads, k), chosen
    values, index = _running_top(z, feats.in_pairs, rows, k + 1)  # one extra rank shows a tied boundary
    kept = values.shape[2]
    if kept > k:
        last = values.gather(2, (counts - 1).clamp(min=0)[..., None])
        after = values.gather(2, counts[..., None].clamp(max=kept - 1))
        tied = (last == after).squeeze(2) & (counts > 0) & (counts < feats.n_pairs[:, None])
        if bool(tied.any()):
            # the tied heads again: every pair above the k-th value, and as many equal to it as
            # the top k holds, in (i, j) order
            values, index = values[..., :k].clone(), index[..., :k].clone()
            window, head = tied.nonzero(as_tuple=True)
            bound = values[window, head, k - 1]
            take_equal = k - _count(values[window, head] > bound[:, None], dim=1)
            values[window, head], index[window, head] = _collect_pairs(
                z[window, head][:, None], feats.in_pairs[window], rows, k, bound[:, None], take_equal[:, None]
            )
            return values, index, chosen
    return values[..., :k], index[..., :k], chosen


def _global_index(first: int, width: int, n_pos: int, pos: torch.Tensor) -> torch.Tensor:
    """Index i·pos + j of entry ``pos`` of a flattened chunk from ``_similarity_rows``."""
    row = torch.div(pos, width, rounding_mode="floor")
    return (row + first) * n_pos + (pos - row * width) + first + 1


def _running_top(z: torch.Tensor, in_pairs: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each head's masked similarity matrix, chunk by chunk: values
    ``[batch, head, k]`` sorted descending and their indices i·pos + j (order among equal values
    unspecified, as ``torch.topk``'s)."""
    n_pos = z.shape[2]
    values: torch.Tensor | None = None
    index: torch.Tensor | None = None
    for first, sim in _similarity_rows(z, in_pairs, rows):
        flat = sim.flatten(2)
        part, pos = torch.topk(flat, min(k, flat.shape[2]), dim=2, sorted=False)
        part_index = _global_index(first, sim.shape[3], n_pos, pos)
        if values is not None and index is not None:
            part, part_index = torch.cat([values, part], dim=2), torch.cat([index, part_index], dim=2)
            part, pos = torch.topk(part, min(k, part.shape[2]), dim=2, sorted=False)
            part_index = part_index.gather(2, pos)
        values, index = part, part_index
    assert values is not None and index is not None  # pos ≥ 2: at least one chunk
    values, order = torch.sort(values, dim=2, descending=True)
    return values, index.gather(2, order)


def _collect_pairs(
    z: torch.Tensor,
    in_pairs: torch.Tensor,
    rows: int,
    k: int,
    bound: torch.Tensor,
    take_equal: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head (``[batch·head, k]``): the pairs above ``bound`` ``[batch, head]`` and the first
    ``take_equal`` pairs equal to it in (i, j) order (``None``: every pair at or above it, -inf
    excluded), sorted by value descending, ties in (i, j) order; unused ranks hold -inf, pair 0.
    ``in_pairs``: ``[batch, pos]``, as for ``_similarity_rows``."""
    batch, heads, n_pos, _ = z.shape
    values = torch.full((batch * heads, k), float("-inf"), device=z.device, dtype=z.dtype)
    index = torch.zeros(batch * heads, k, dtype=torch.long, device=z.device)
    filled = torch.zeros(batch * heads, dtype=torch.long, device=z.device)
    equal_seen = torch.zeros(batch * heads, dtype=torch.long, device=z.device)
    edge = bound.reshape(batch * heads, 1)
    for first, sim in _similarity_rows(z, in_pairs, rows):
        width = sim.shape[3]
        flat = sim.view(batch * heads, -1)
        if take_equal is None:
            keep = (flat >= edge) & (flat > float("-inf"))
        else:
            keep = flat > edge
            # rank the entries equal to the bound among the head's equal entries so far
            eq_row, eq_pos = (flat == edge).nonzero(as_tuple=True)
            found = torch.bincount(eq_row, minlength=batch * heads)
            rank = torch.arange(eq_row.numel(), device=z.device) - (torch.cumsum(found, 0) - found)[eq_row]
            take = rank + equal_seen[eq_row] < take_equal.reshape(-1)[eq_row]
            keep[eq_row[take], eq_pos[take]] = True
            equal_seen += found
        head_row, pos = keep.nonzero(as_tuple=True)  # row-major: (i, j) order within each head
        found = torch.bincount(head_row, minlength=batch * heads)
        slot = torch.arange(head_row.numel(), device=z.device) - (torch.cumsum(found, 0) - found)[head_row]
        slot += filled[head_row]
        values[head_row, slot] = flat[head_row, pos]
        index[head_row, slot] = _global_index(first, width, n_pos, pos)
        filled += found
    # taken in (i, j) order: a stable sort by value puts equal values in (i, j) order
    values, order = torch.sort(values, dim=1, descending=True, stable=True)
    return values, index.gather(1, order)


def head_statistics(
    z: torch.Tensor,
    attn: torch.Tensor | AttentionRows,
    feats: WindowFeatures,
    *,
    select: Selection,
    gate: float,
    seq_len: int,
    csm_bin: int = 0,
    chunk_rows: int | None = None,
) -> dict[str, torch.Tensor]:
    """Additive per-head sums for one layer of one batch (SPEC §4, §5b, §5c, §8).

    z: ``[batch, head, pos, d]`` head outputs; attn: ``[batch, head, pos, key]``, or the
    ``AttentionRows`` of a long window's attention taken in row blocks (its entries recomputed
    where the gate reads them, its row sums gathered during the forward pass by ``RowSums``).
    Returns ``[head]`` tensors for HEAD_SUMS, ``dist_hist`` and ``attended_hist``
    ``[head, seq_len]`` (index = distance j - i) — each with a leading ``[group]`` axis when
    ``feats`` has replicate groups — and per-window anchors ``anchor_pos`` / ``anchor_count`` /
    ``high_count`` ``[batch, head]`` (position of the anchor token's first occurrence).
    The anchor sums of HEAD_SUMS (``anchor_frequent``, ``anchored_windows``) are added by the
    caller, which knows the anchors' token ids. ``same_sentence_hist`` ``[(group,) head, seq_len]``:
    the pairs of H at each distance that share a sentence. ``csm_bin`` > 0: also ``csm_sum`` and
    ``csm_count`` ``[kind, head, bin, bin]``, the averaged similarity matrices' sums
    (``service.engine.averaged_csm``). ``chunk_rows``: rows of the similarity matrix computed at
    a time (``select_pairs_chunked``); default: whole matrices while a batch's fit in
    ``SIM_CHUNK_ELEMENTS``, row chunks beyond.
    """
    z = _at_least_float32(z)
    # an AttentionRows (row_attention): never whole; a tensor: the whole maps
    rows_attn = None if isinstance(attn, torch.Tensor) else attn
    whole_attn = _at_least_float32(attn) if isinstance(attn, torch.Tensor) else None
    batch, heads, n_pos, _ = z.shape
    rows = similarity_chunk_rows(batch, heads, n_pos) if chunk_rows is None else max(1, chunk_rows)
    if rows >= n_pos:
        selected = select_pairs(masked_similarity(z, feats), feats, select)
    else:
        selected = select_pairs_chunked(z, feats, select, rows=rows)
    # a near-constant head's rows ranked again at float64, whichever way they were selected
    values, index, chosen = rerank_unresolved(z, feats, select, *selected, chunk_rows=chunk_rows)
    chosen_f = chosen.to(z.dtype)
    pos_i, pos_j = index // n_pos, index % n_pos  # [batch, head, k]
    flat_i, flat_j = pos_i.flatten(1), pos_j.flatten(1)  # [batch, head·k]

    def pick(token_values: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        return token_values.gather(1, flat).view_as(index)

    def count(mask: torch.Tensor) -> torch.Tensor:  # [batch, head, k] -> [(group,) head]
        return feats.reduce((mask & chosen).long().sum(2))

    out: dict[str, torch.Tensor] = {}
    out["high_pairs"] = feats.reduce(chosen.long().sum(2))
    out["sim_sum_all"] = feats.reduce(_pair_sum(z, feats.in_pairs))
    out["sim_sum_high"] = feats.reduce(torch.where(chosen, values, 0.0).sum(2, dtype=torch.float64))
    sent_i, sent_j = pick(feats.sentence, flat_i), pick(feats.sentence, flat_j)
    same_sentence = (sent_i == sent_j) & (sent_i >= 0)
    same_token = pick(feats.input_ids, flat_i) == pick(feats.input_ids, flat_j)
    out["same_sentence_high"] = count(same_sentence)
    out["same_token_high"] = count(same_token)
    out["same_word_high"] = count(same_token & pick(feats.is_word, flat_i))
    if rows_attn is not None:  # the entries recomputed from the queries and keys
        a_ij, a_ji = rows_attn.entries(index), rows_attn.entries(pos_j * n_pos + pos_i)
    else:
        assert whole_attn is not None
        flat_attn = whole_attn.flatten(2)
        a_ij = flat_attn.gather(2, index)
        a_ji = flat_attn.gather(2, pos_j * n_pos + pos_i)
    # SPEC §8: attended when max(A_ij·k_i, A_ji·k_j) ≥ gate, compared as A ≥ gate / k so that
    # bidirectional attention (k = n) gives §3's max(A_ij, A_ji) ≥ gate / n to the last bit
    threshold = gate / feats.visible.to(whole_attn.dtype if whole_attn is not None else torch.float32)  # [batch, pos]
    attended = ((a_ij >= pick(threshold, flat_i)) | (a_ji >= pick(threshold, flat_j))) & chosen
    out["attended_high"] = count(attended)

    distance = torch.where(chosen, pos_j - pos_i, 0)  # [batch, head, k]; unchosen ranks may be j <= i
    out["dist_hist"] = feats.reduce(_histogram(distance, chosen, seq_len))
    out["attended_hist"] = feats.reduce(_histogram(distance, attended, seq_len))
    out["same_sentence_hist"] = feats.reduce(_histogram(distance, same_sentence & chosen, seq_len))
    if csm_bin:
        from headatlas.service.engine.averaged_csm import averaged_csm_sums

        out["csm_sum"], out["csm_count"] = averaged_csm_sums(
            z, feats.in_pairs, values, index, chosen, attended, bin_size=csm_bin, n_bins=-(-seq_len // csm_bin)
        )

    # anchors (SPEC §4): endpoint counts per token, kept at the position of the token's first
    # occurrence in the window; on a tie the token whose first occurrence in the window is earliest
    # wins, whether or not that occurrence is itself an endpoint of H. The smallest tied position
    # is taken explicitly (not left to how max picks among equal values on a device).
    endpoint = torch.zeros(batch, heads, n_pos, device=z.device, dtype=chosen_f.dtype)
    endpoint.scatter_add_(2, pick(feats.first_pos, flat_i), chosen_f)
    endpoint.scatter_add_(2, pick(feats.first_pos, flat_j), chosen_f)
    anchor_count = endpoint.amax(dim=2)
    positions = torch.arange(n_pos, device=z.device)
    anchor_pos = torch.where(endpoint == anchor_count[..., None], positions, n_pos).amin(dim=2)
    out["anchor_pos"] = anchor_pos
    out["anchor_count"] = anchor_count.long()
    out["high_count"] = chosen.long().sum(2)

    if rows_attn is not None:  # gathered from the row blocks during the forward pass (RowSums)
        if rows_attn.sums is None:
            raise ValueError("attention in row blocks without their sums: run the forward pass with a RowSums observer")
        out.update(rows_attn.sums)
    else:
        assert whole_attn is not None
        out.update(attention_sums(whole_attn, feats, work=feats.workspace))
        out.update(copy_sums(whole_attn, feats))
    return out


class RowSums:
    """The sums of ``attention_sums`` and ``copy_sums``, gathered from the attention probabilities
    a block of query rows at a time (``row_attention``: the forward pass hands each block over as
    it is made, so no layer holds every head's pos × pos map). Call with ``(first, probs)``,
    ``probs`` ``[batch, head, rows, key]`` for query rows ``first ..``; ``result()`` gives the
    same keys as the two functions. The same quantities, summed block by block (float64 across
    blocks): equal to the whole map's up to float32 rounding."""

    def __init__(self, feats: WindowFeatures) -> None:
        self.feats = feats
        self.parts: dict[str, torch.Tensor] = {}

    def _add(self, key: str, value: torch.Tensor) -> None:
        self.parts[key] = self.parts[key] + value if key in self.parts else value

    def __call__(self, first: int, probs: torch.Tensor) -> None:
        feats = self.feats
        batch, heads, n_rows, n_pos = probs.shape
        last = first + n_rows
        rows = feats.valid.to(probs.dtype)[:, None, :]  # [batch, 1, pos]
        block = rows[..., first:last]
        received = torch.matmul(block[:, :, None, :], probs)  # [batch, head, 1, key]
        by_class = torch.matmul(received, feats.key_classes[:, None].to(probs.dtype))  # [batch, head, 1, 4]
        self._add("by_class", by_class.sum(dim=2, dtype=torch.float64))
        self._add("attn_to_self", _row_sum(torch.diagonal(probs, first, 2, 3), block))
        low = max(first, 1)  # A_{i, i-1} of rows i ≥ 1, weighed by row i
        if low < last:
            prev = torch.diagonal(probs[:, :, low - first :], low - 1, 2, 3)
            self._add("attn_to_prev", _row_sum(prev, rows[..., low:last]))
        high = min(last, n_pos - 1)  # A_{i, i+1} of rows i ≤ pos − 2, weighed by row i + 1
        if first < high:
            after = torch.diagonal(probs[:, :, : high - first], first + 1, 2, 3)
            self._add("attn_to_next", _row_sum(after, rows[..., first + 1 : high + 1]))
        self._add("attn_entropy", _row_sum(_entropy_rows(probs, None), block))
        # the copy sets' entries in these rows (each entry lies in one block: summed exactly)
        index = feats.copy_index  # [batch, copy], i·pos + key
        inside = (index >= first * n_pos) & (index < last * n_pos)
        local = torch.where(inside, index - first * n_pos, 0)[:, None, :].expand(-1, heads, -1)
        picked = probs.reshape(batch, heads, n_rows * n_pos).gather(2, local)
        self._add("copies", torch.where(inside[:, None, :], picked, 0.0))

    def result(self) -> dict[str, torch.Tensor]:
        feats, parts = self.feats, self.parts
        by_class = feats.reduce(parts["by_class"])  # [(group,) head, 4]
        zero = torch.zeros_like(parts["attn_to_self"])
        copies = torch.matmul(parts["copies"], feats.copy_weights(parts["copies"].dtype))  # [batch, head, 2]
        copies = feats.reduce(copies.double())
        return {
            "attn_to_cls": by_class[..., 0],
            "attn_to_sep": by_class[..., 1],
            "attn_to_punct": by_class[..., 2],
            "attn_to_first": by_class[..., 3],
            "attn_to_self": feats.reduce(parts["attn_to_self"]),
            "attn_to_prev": feats.reduce(parts.get("attn_to_prev", zero)),
            "attn_to_next": feats.reduce(parts.get("attn_to_next", zero)),
            "attn_entropy": feats.reduce(parts["attn_entropy"]),
            "attn_dup": copies[..., 0],
            "attn_induction": copies[..., 1],
        }


def copy_sums(attn: torch.Tensor, feats: WindowFeatures) -> dict[str, torch.Tensor]:
    """``attn_dup`` and ``attn_induction`` (SPEC §8): Σ over query rows of the weight on D(i), on
    I(i); ``[head]`` float64 each (``[group, head]`` with replicate groups).

    attn: ``[batch, head, pos, key]``. Only the entries of D and I are read (``copy_index``, a few
    hundred per window of text against pos² in the map), then weighed by their kind."""
    batch, heads, n_pos, _ = attn.shape
    index = feats.copy_index[:, None, :].expand(-1, heads, -1)  # [batch, head, copy]
    picked = attn.reshape(batch, heads, n_pos * n_pos).gather(2, index)
    sums = torch.matmul(picked, feats.copy_weights(attn.dtype))  # [batch, head, 2]
    sums = feats.reduce(sums.double())
    return {"attn_dup": sums[..., 0], "attn_induction": sums[..., 1]}


def _histogram(distance: torch.Tensor, mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Per window and head, the pairs of ``mask`` by distance: ``[batch, head, k]`` → ``[batch, head, seq_len]``."""
    batch, heads, _ = distance.shape
    hist = torch.zeros(batch, heads, seq_len, dtype=torch.long, device=distance.device)
    return hist.scatter_add_(2, distance, mask.long())


def attention_sums(attn: torch.Tensor, feats: WindowFeatures, work: Workspace | None = None) -> dict[str, torch.Tensor]:
    """Σ over valid query rows of attention to categories, ``[head]`` float64 each
    (``[group, head]`` when ``feats`` has replicate groups).

    attn: ``[batch, head, pos, key]``, rows are queries.
    """
    rows = feats.valid.to(attn.dtype)[:, None, :]  # [batch, 1, pos]
    # Σ_i row_i Σ_j A_ij class_j = Σ_j (Σ_i row_i A_ij) class_j: one pass over A for the column
    # sums, then a small product (a [pos, 4] right-hand side wastes most of a matmul's work)
    received = torch.matmul(rows[:, :, None, :], attn)  # [batch, head, 1, key]
    by_class = torch.matmul(received, feats.key_classes[:, None].to(attn.dtype))  # [batch, head, 1, 4]
    by_class = feats.reduce(by_class.sum(dim=2, dtype=torch.float64))  # [(group,) head, 4]
    neighbour_rows = rows[..., 1:]
    return {
        "attn_to_cls": by_class[..., 0],
        "attn_to_sep": by_class[..., 1],
        "attn_to_punct": by_class[..., 2],
        "attn_to_first": by_class[..., 3],
        "attn_to_self": feats.reduce(_row_sum(torch.diagonal(attn, 0, 2, 3), rows)),
        "attn_to_prev": feats.reduce(_row_sum(torch.diagonal(attn, -1, 2, 3), neighbour_rows)),
        "attn_to_next": feats.reduce(_row_sum(torch.diagonal(attn, 1, 2, 3), neighbour_rows)),
        "attn_entropy": feats.reduce(_row_sum(_entropy_rows(attn, work), rows)),
    }


def _entropy_rows(attn: torch.Tensor, work: Workspace | None) -> torch.Tensor:
    """-Σ_key A ln A per row (0 ln 0 = 0), ``[batch, head, pos]``, via a reused buffer.

    0 ln 0 is 0 · ln(tiny): A clamped to the dtype's smallest normal number, a plain logarithm,
    a product. On CPU that takes half the time of ``xlogy`` (``benchmarks/breakdown.py``, one layer of
    a 32-window MiniLM batch: 25.5 ms before, 12.2 after), with the same rounding (both within
    5.5e-7 of float64 on such maps)."""
    out = work.buffer("entropy", attn.shape, attn.dtype) if work is not None else None
    logs = torch.clamp(attn, min=torch.finfo(attn.dtype).tiny, out=out).log_()
    return logs.mul_(attn).sum(3).neg_()


class Workspace:
    """Large scratch tensors reused across the layers of a batch.

    Allocating a fresh [batch, head, pos, pos] tensor per layer costs page faults on CPU that
    are comparable to the arithmetic done in it.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != torch.Size(shape) or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision activations are summarised in float32; float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _row_sum(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[batch, head, pos]`` weighted by valid rows → ``[batch, head]`` float64."""
    return (values * rows).sum(dim=2, dtype=torch.float64)


def _pair_sum(z: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Σ over pairs i < j of members of z_i·z_j, per window and head ``[batch, head]``:
    (|Σz|² − Σ|z|²) / 2.

    O(pos·d) instead of O(pos²·d); the two terms are combined in float64.
    """
    zw = z * members.to(z.dtype)[:, None, :, None]  # [batch, head, pos, d], non-members zeroed
    total = zw.sum(2).double()  # [batch, head, d]
    squares = (zw * z).sum(dim=(2, 3)).double()  # [batch, head]
    return ((total * total).sum(2) - squares) / 2


def _count(mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Count True values; summing uint8 is much faster than bool ``sum`` on CPU."""
    as_bytes = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
    if dim is None:
        return as_bytes.sum(dtype=torch.long)
    return as_bytes.sum(dim=dim, dtype=torch.long)
