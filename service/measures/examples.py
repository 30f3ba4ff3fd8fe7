"""Top examples per head: the windows where a head's anchor, its most similar pair and its
strongest attention are strongest, kept in a reservoir of ``k`` per (kind, layer, head).

Each window gives every head one candidate of each kind (``KINDS``):

- ``anchor``: the window's anchor (SPEC §4), scored by its endpoint count in H (``anchor_count``:
  how many high-similarity pairs it ties together); ``value`` = its ``anchor_share``; ``pos_i`` =
  the anchor token's first position, ``pos_j`` = -1. A window without a pair in H gives none.
- ``pair``: the pair of H with the largest ``C_ij`` (ties: the smaller i, then j); score = value =
  ``C_ij``; ``pos_i < pos_j``.
- ``attention``: the entry ``A_ij``, query i and key j two different tokens of the pair universe
  (non-special unless ``include_special``), with the largest ``A_ij · k_i`` (times the uniform
  weight, as the gate of SPEC §8 reads it: an early decoder row's few keys do not pass for a strong
  link); score = ``A_ij · k_i``, value = ``A_ij``; ``pos_i`` the query, ``pos_j`` the key.

A reservoir keeps, per (kind, layer, head), the ``k`` best candidates in one total order: score
descending, then window id, ``pos_i``, ``pos_j`` ascending. A window gives one candidate per cell,
so the top k of the union of two reservoirs is the top k of their tops: ``merge`` is associative
and commutative, and a run's examples do not depend on how its windows were cut into batches or in
which order the batches were stored. What is kept grows with heads × k, not with the corpus.

Pure computation: numpy, and torch for the per-layer candidates (no database, no queue).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

    from headatlas.service.engine.features import WindowFeatures

KINDS = ("anchor", "pair", "attention")
NONE = -1  # an empty slot's window index and positions; pos_j of an anchor


class Candidates(NamedTuple):
    """One kind's candidate of every (window, head) of a layer, ``[batch, head]`` each; a
    (window, head) without one has score -inf."""

    score: torch.Tensor
    value: torch.Tensor
    pos_i: torch.Tensor
    pos_j: torch.Tensor


def layer_candidates(
    stats: Mapping[str, torch.Tensor],
    attn: torch.Tensor | None,
    feats: WindowFeatures,
    weight: torch.Tensor | None = None,
    buffer: torch.Tensor | None = None,
) -> dict[str, Candidates]:
    """The candidates of one layer by kind, from the layer's head statistics (``stats``:
    ``anchor_pos``, ``anchor_count``, ``high_count``, ``top_pair_value``, ``top_pair_index``, each
    ``[batch, head]``) and its attention probabilities (``attn`` ``[batch, head, pos, key]``; None
    where the layer's attention was taken in row blocks and no whole map exists: no attention
    candidates then); ``weight``: ``attention_weight(feats)``, made once per batch; ``buffer``:
    room for ``attn`` times the weights, shared by a batch's layers (``attention_candidates``)."""
    import torch

    n_pos = feats.valid.shape[1]
    high = stats["high_count"]
    anchored = high > 0
    count = stats["anchor_count"].to(torch.float64)
    minus = torch.full_like(count, float("-inf"))
    out = {
        "anchor": Candidates(
            torch.where(anchored, count, minus),
            count / (2 * high.clamp(min=1)).to(torch.float64),
            stats["anchor_pos"],
            torch.full_like(stats["anchor_pos"], NONE),
        )
    }
    top = stats["top_pair_value"].to(torch.float64)
    index = stats["top_pair_index"]
    out["pair"] = Candidates(top, top, index // n_pos, index % n_pos)
    if attn is not None:
        out["attention"] = attention_candidates(attn, feats, weight, buffer)
    return out


# entries of the attention maps multiplied at a time (float32: 64 MiB): a batch of long windows is
# searched a few windows at a time, so the search adds at most this much to a layer's memory
CHUNK_ELEMENTS = 1 << 24


def attention_candidates(
    attn: torch.Tensor, feats: WindowFeatures, weight: torch.Tensor | None = None, buffer: torch.Tensor | None = None
) -> Candidates:
    """Per (window, head) the entry of ``attn`` ``[batch, head, pos, key]`` with the largest
    ``A_ij · k_i`` over i ≠ j, both tokens of the pair universe (``feats.in_pairs``); ties go to the
    smaller i, then j. ``weight``: ``attention_weight(feats)``, made once per batch; ``buffer``:
    room for ``chunk_windows`` windows' products (``attention_buffer``; a batch's layers share one)."""
    import torch

    batch, heads, n_pos, _ = attn.shape
    if weight is None:
        weight = attention_weight(feats)
    if buffer is None:
        buffer = attention_buffer(attn)
    step = buffer.shape[0]
    parts = []
    for first in range(0, batch, step):
        maps = attn[first : first + step]
        size = maps.shape[0]
        # the entries left out weigh 0, and every entry of a softmax is > 0 (a window whose
        # entries are all left out has score 0 there: none)
        scaled = torch.mul(maps, weight[first : first + step].to(attn.dtype), out=buffer[:size])
        best, row = scaled.amax(dim=3).max(dim=2)  # the first row holding the largest: the smaller i
        rows = row[..., None, None].expand(size, heads, 1, n_pos)
        key = scaled.gather(2, rows).squeeze(2).argmax(dim=2)  # then the first key: the smaller j
        value = maps.gather(2, rows).squeeze(2).gather(2, key[..., None]).squeeze(2)
        parts.append((best, value, row, key))
    best, value, row, key = (torch.cat(p) for p in zip(*parts))
    best = best.double()
    return Candidates(torch.where(best > 0, best, float("-inf")), value.double(), row, key)


def attention_buffer(attn: torch.Tensor) -> torch.Tensor:
    """Room for the products of as many of ``attn``'s windows as ``CHUNK_ELEMENTS`` allows (at least one)."""
    import torch

    batch, heads, n_pos, _ = attn.shape
    return torch.empty(
        (min(batch, max(1, CHUNK_ELEMENTS // (heads * n_pos * n_pos))), heads, n_pos, n_pos),
        dtype=attn.dtype,
        device=attn.device,
    )


def attention_weight(feats: WindowFeatures) -> torch.Tensor:
    """``[batch, 1, pos, key]``: ``k_i`` where query i and key j ≠ i are tokens of the pair
    universe, 0 elsewhere (float32)."""
    import torch

    n_pos = feats.in_pairs.shape[1]
    allowed = feats.in_pairs[:, :, None] & feats.in_pairs[:, None, :]  # [batch, pos, key]
    allowed &= ~torch.eye(n_pos, dtype=torch.bool, device=allowed.device)
    return (allowed * feats.visible.to(torch.float32)[:, :, None])[:, None]


class Example(NamedTuple):
    kind: str
    layer: int
    head: int
    rank: int  # 1 = the strongest
    score: float
    value: float
    window_id: str
    pos_i: int
    pos_j: int  # -1: none (an anchor)


@dataclass(frozen=True)
class Reservoir:
    """The ``k`` best examples of each (kind, layer, head), best first: ``score``, ``value``
    float64, ``window`` (window ids, object; "" in an empty slot), ``pos_i``, ``pos_j`` int64
    (-1 in an empty slot), each ``[kind, layer, head, k]`` (kind: ``KINDS``); an empty slot's
    score is -inf, and empty slots come last."""

    k: int
    score: np.ndarray
    value: np.ndarray
    window: np.ndarray
    pos_i: np.ndarray
    pos_j: np.ndarray

    @classmethod
    def empty(cls, k: int, n_layers: int, n_heads: int) -> Reservoir:
        shape = (len(KINDS), n_layers, n_heads, k)
        return cls(
            k,
            np.full(shape, -np.inf),
            np.full(shape, np.nan),
            np.full(shape, "", dtype=object),
            np.full(shape, NONE, dtype=np.int64),
            np.full(shape, NONE, dtype=np.int64),
        )

    @classmethod
    def of_windows(
        cls,
        k: int,
        window_ids: Sequence[str],
        score: np.ndarray,
        value: np.ndarray,
        pos_i: np.ndarray,
        pos_j: np.ndarray,
    ) -> Reservoir:
        """The reservoir of one set of windows: ``score``, ``value``, ``pos_i``, ``pos_j``
        ``[kind, window, layer, head]`` (a window without a candidate: score -inf), window
        ``w`` being ``window_ids[w]``."""
        n_kinds, n_windows, n_layers, n_heads = np.shape(score)
        if n_kinds != len(KINDS) or n_windows != len(window_ids):
            raise ValueError(
                f"candidates of shape {np.shape(score)} for {len(KINDS)} kinds and {len(window_ids)} windows"
            )

        def cells(a: np.ndarray) -> np.ndarray:  # [kind, window, layer, head] -> [kind, layer, head, window]
            return np.moveaxis(np.asarray(a), 1, 3)

        ids = np.empty(n_windows, dtype=object)
        ids[:] = list(window_ids)
        window = np.broadcast_to(ids, (n_kinds, n_layers, n_heads, n_windows))
        return _top(
            k,
            cells(score).astype(np.float64),
            cells(value).astype(np.float64),
            window,
            cells(pos_i).astype(np.int64),
            cells(pos_j).astype(np.int64),
        )

    def merge(self, other: Reservoir) -> Reservoir:
        """The ``k`` best of both (the larger ``k`` of the two)."""
        if self.score.shape[:3] != other.score.shape[:3]:
            raise ValueError(f"reservoirs of different heads: {self.score.shape[:3]} and {other.score.shape[:3]}")
        return _top(
            max(self.k, other.k),
            *(np.concatenate([a, b], axis=3) for a, b in zip(self._arrays(), other._arrays())),
        )

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return self.score, self.value, self.window, self.pos_i, self.pos_j

    def examples(self) -> Iterator[Example]:
        """The kept examples, by kind, layer, head and rank."""
        kinds, layers, heads, ranks = np.nonzero(np.isfinite(self.score))
        for c, l, h, r in zip(kinds.tolist(), layers.tolist(), heads.tolist(), ranks.tolist()):
            yield Example(
                KINDS[c],
                l,
                h,
                r + 1,
                float(self.score[c, l, h, r]),
                float(self.value[c, l, h, r]),
                str(self.window[c, l, h, r]),
                int(self.pos_i[c, l, h, r]),
                int(self.pos_j[c, l, h, r]),
            )

    def window_ids(self) -> list[str]:
        """The windows some kept example is of, sorted."""
        return sorted({str(w) for w in self.window[np.isfinite(self.score)]})

    # --- as a batch result carries it (numeric arrays: windows as indices into its window ids) ---
    def payload(self, window_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The arrays that travel in ``BatchResult.measures["examples"]``: ``window`` as the index of
        each example's window among ``window_ids`` (the batch's), -1 in an empty slot."""
        where = {w: i for i, w in enumerate(window_ids)}
        window = np.array([where.get(w, NONE) for w in self.window.ravel()], dtype=np.int64).reshape(self.window.shape)
        return {
            "k": np.array(self.k, dtype=np.int64),
            "score": self.score,
            "value": self.value,
            "window": window,
            "pos_i": self.pos_i,
            "pos_j": self.pos_j,
        }

    @classmethod
    def of_payload(cls, arrays: Mapping[str, np.ndarray], window_ids: Sequence[str]) -> Reservoir:
        """``payload``'s reservoir again, ``window_ids`` the batch's."""
        ids = np.empty(len(window_ids) + 1, dtype=object)
        ids[:-1] = list(window_ids)
        ids[-1] = ""  # index -1: an empty slot
        index = np.asarray(arrays["window"], dtype=np.int64)
        return cls(
            int(arrays["k"]),
            np.asarray(arrays["score"], dtype=np.float64),
            np.asarray(arrays["value"], dtype=np.float64),
            ids[index],
            np.asarray(arrays["pos_i"], dtype=np.int64),
            np.asarray(arrays["pos_j"], dtype=np.int64),
        )


def text_array(texts: Sequence[str]) -> np.ndarray:
    """Strings as one array a batch result can carry: a JSON list, UTF-8 bytes (a numpy string
    array takes four bytes a character, padded to the longest)."""
    import json

    return np.frombuffer(json.dumps(list(texts), ensure_ascii=False).encode(), dtype=np.uint8)


def array_texts(array: np.ndarray) -> list[str]:
    """``text_array``'s strings again."""
    import json

    return json.loads(np.asarray(array, dtype=np.uint8).tobytes().decode())


def _top(
    k: int, score: np.ndarray, value: np.ndarray, window: np.ndarray, pos_i: np.ndarray, pos_j: np.ndarray
) -> Reservoir:
    """The ``k`` best along the last axis: score descending (NaN as -inf), then window id, pos_i,
    pos_j ascending; fewer than ``k`` candidates leave empty slots after them."""
    score = np.where(np.isnan(score), -np.inf, score)
    _, rank = np.unique(np.asarray(window, dtype=object).ravel().astype(str), return_inverse=True)
    rank = rank.reshape(np.shape(window))
    order = np.lexsort((pos_j, pos_i, rank, -score), axis=-1)[..., :k]
    picked = [np.take_along_axis(np.asarray(a), order, axis=-1) for a in (score, value, window, pos_i, pos_j)]
    width = picked[0].shape[-1]
    if width < k:  # fewer candidates than slots
        pad = [(0, 0)] * (score.ndim - 1) + [(0, k - width)]
        fills: tuple = (-np.inf, np.nan, "", NONE, NONE)
        picked = [np.pad(a, pad, constant_values=f) for a, f in zip(picked, fills)]
    score_k, value_k, window_k, i_k, j_k = picked
    empty = ~np.isfinite(score_k)
    window_k = np.where(empty, "", window_k).astype(object)
    return Reservoir(
        k,
        score_k,
        np.where(empty, np.nan, value_k),
        window_k,
        np.where(empty, NONE, i_k).astype(np.int64),
        np.where(empty, NONE, j_k).astype(np.int64),
    )
