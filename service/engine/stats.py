"""Per-head statistics of the context similarity matrix and the attention map (SPEC §2–4).

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Everything is vectorised over
the batch and the heads; no Python loop runs over tokens or heads. The features they read are
made by ``service.engine.features``, the high pairs chosen by ``service.engine.pair_selection``,
the head-independent chance sums by ``service.engine.chance``.

Dimension names used in shape comments: batch, head, pos (query or key position), key, d_head,
pair (index into the strict upper triangle i < j of a pos × pos matrix, row-major), k (rank
among the selected pairs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from headatlas.service.engine.features import WindowFeatures, Workspace, at_least_float32
from headatlas.service.engine.pair_selection import (
    masked_similarity,
    rerank_unresolved,
    select_pairs,
    select_pairs_chunked,
    similarity_chunk_rows,
)
from headatlas.service.params import Selection

if TYPE_CHECKING:
    from headatlas.service.engine.row_attention import AttentionRows


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
    z = at_least_float32(z)
    # an AttentionRows (row_attention): never whole; a tensor: the whole maps
    rows_attn = None if isinstance(attn, torch.Tensor) else attn
    whole_attn = at_least_float32(attn) if isinstance(attn, torch.Tensor) else None
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
    out["top_pair_value"], out["top_pair_index"] = _top_pair(values, index, chosen, n_pos)
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


def _top_pair(
    values: torch.Tensor, index: torch.Tensor, chosen: torch.Tensor, n_pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (window, head) the largest C_ij of H and its pair's index i·pos + j, ``[batch, head]``
    (the head's top examples, service/measures/examples.py); ties go to the smaller i, then j (the
    smaller index). A window without a pair in H: -inf and index 0."""
    batch, heads, _ = index.shape
    if index.shape[2] == 0:
        return values.new_full((batch, heads), float("-inf")), index.new_zeros((batch, heads))
    top = torch.where(chosen, values, float("-inf")).amax(dim=2)  # [batch, head]
    at_top = chosen & (values == top[..., None])
    first = torch.where(at_top, index, n_pos * n_pos).amin(dim=2)
    return top, torch.where(first < n_pos * n_pos, first, 0)


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
