"""Per-batch token and pair features shared by every layer's statistics (SPEC §1, §5b, §8): the
pair layout, sentence ids, token classes, copy sets, and the scratch buffers reused across layers.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Dimension names used in shape comments: batch, head, pos (query or key position), key, d_head,
pair (index into the strict upper triangle i < j of a pos × pos matrix, row-major), k (rank
among the selected pairs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import torch

from headatlas.service.engine.windows import TokenClasses


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


def at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision activations are summarised in float32; float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def count_true(mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Count True values; summing uint8 is much faster than bool ``sum`` on CPU."""
    as_bytes = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
    if dim is None:
        return as_bytes.sum(dtype=torch.long)
    return as_bytes.sum(dim=dim, dtype=torch.long)
