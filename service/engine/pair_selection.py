"""The context similarity matrix and its high-similarity pairs H (SPEC §2–3): per-head output
vectors, the masked similarity matrix, top-pair selection (whole or in row chunks, so a long
window holds pos · rows entries per head, not pos²), and the float64 re-ranking of the rows
float32 cannot rank.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Everything is vectorised over
the batch and the heads. Shape names as in ``service.engine.features``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from headatlas.service.engine.features import WindowFeatures, at_least_float32, count_true
from headatlas.service.params import Selection


def head_vectors(context: torch.Tensor, n_heads: int, w_o: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head output vectors from the self-attention context layer.

    context: ``[batch, pos, head·d_head]`` (before W_O). Returns ``[batch, head, pos, d_head]``,
    or ``[batch, head, pos, d_model]`` when ``w_o`` (``[d_model, head·d_head]``, the dense
    weight of the attention output) is given: ``z_i W_O^h`` without bias (SPEC §2, post_wo).
    """
    batch, n_pos, width = context.shape
    context = at_least_float32(context)  # half-precision forward, float32 statistics
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
        counts = count_true(chosen_mask, dim=2)  # [batch, head]
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
            counts += count_true((flat >= threshold[..., None]) & (flat > float("-inf")), dim=2)
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
            take_equal = k - count_true(values[window, head] > bound[:, None], dim=1)
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
