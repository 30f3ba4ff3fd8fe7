"""Corpus-averaged context similarity matrices (SPEC §5c): per head, Σ C_ij over windows by
position, in square bins of ``bin_size`` positions, with the number of pairs summed in each cell.

Pure tensor code, like ``service.engine.stats``: imports neither Celery, Typer nor SQLAlchemy. Only the
upper triangle is kept (pairs i < j of P, so bin_i ≤ bin_j); the mean matrix is symmetric.
Shape names as in ``service.engine.stats``, plus ``bin`` (index of a bin of positions) and ``cell``
(bin_i · bins + bin_j).
"""

from __future__ import annotations

import torch

from headatlas.service.engine.results import CSM_KINDS  # noqa: F401 - defined numpy-only, re-exported


def binned_pair_sums(
    z: torch.Tensor, members: torch.Tensor, *, bin_size: int, n_bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over the batch of C_ij = z_i · z_j for the pairs i < j of ``members``, by bin.

    z: ``[batch, head, pos, d]``; members: ``[batch, pos]`` bool (the pair universe's tokens).
    Returns sums ``[head, bin, bin]`` float64 and pair counts ``[bin, bin]`` int64, zero below
    the diagonal. A cell's sum is (Σ_{i∈a} z_i)·(Σ_{j∈b} z_j): O(pos·d) per head, never the
    pos × pos matrix; a diagonal cell takes (|Σz|² − Σ|z|²)/2, its pairs i < j.
    """
    n_pos = z.shape[2]
    # [batch, bin, pos]: 1 where the position is a member in that bin. Products with it read z
    # once; a masked, padded copy of z would cost more in fresh memory than the arithmetic.
    in_bin = (torch.arange(n_pos, device=z.device) // bin_size)[None, :] == torch.arange(n_bins, device=z.device)[
        :, None
    ]
    weights = in_bin[None] & members[:, None, :]
    by_bin = torch.matmul(weights[:, None].to(z.dtype), z).double()  # [batch, head, bin, d]
    norms = torch.linalg.vector_norm(z, dim=3).square()  # [batch, head, pos]
    squares = torch.matmul(norms, weights.transpose(1, 2).to(z.dtype)).double().sum(0)  # [head, bin]
    sums = torch.matmul(by_bin, by_bin.transpose(2, 3)).sum(0)  # [head, bin, bin]
    diagonal = sums.diagonal(dim1=1, dim2=2)
    diagonal.copy_((diagonal - squares) / 2)
    m = weights.sum(2)  # [batch, bin] members per bin
    counts = (m[:, :, None] * m[:, None, :]).sum(0)  # [bin, bin]
    counts.diagonal().copy_((m * (m - 1) // 2).sum(0))
    return torch.triu(sums), torch.triu(counts)


def binned_selected_sums(
    values: torch.Tensor,
    index: torch.Tensor,
    kind: torch.Tensor,
    n_kinds: int,
    n_pos: int,
    *,
    bin_size: int,
    n_bins: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over the batch of C_ij and the count of the selected pairs, by kind and bin, in one pass.

    values, index (i·pos + j, i < j): ``[batch, head, k]`` as ``select_pairs`` ranks them; kind:
    ``[batch, head, k]``, which of the ``n_kinds`` matrices the pair adds to (0 … n_kinds − 1), or
    ``n_kinds`` for none. Returns sums ``[kind, head, bin, bin]`` float64 and counts
    ``[kind, head, bin, bin]`` int64.
    """
    heads, cells = index.shape[1], n_bins * n_bins
    cell = (index // n_pos // bin_size) * n_bins + (index % n_pos) // bin_size  # [batch, head, k]
    # one scatter for every kind: kind κ's cells are κ·cells … ; pairs of no kind land past the last
    target = (kind * cells + cell).transpose(0, 1).reshape(heads, -1)
    sums = torch.zeros(heads, (n_kinds + 1) * cells, dtype=torch.float64, device=index.device)
    counts = torch.zeros(heads, (n_kinds + 1) * cells, dtype=torch.long, device=index.device)
    sums.scatter_add_(1, target, values.double().transpose(0, 1).reshape(heads, -1))
    counts.scatter_add_(1, target, torch.ones_like(target))
    shape = (heads, n_kinds, n_bins, n_bins)
    return sums[:, : n_kinds * cells].view(shape).transpose(0, 1), counts[:, : n_kinds * cells].view(shape).transpose(
        0, 1
    )


def averaged_csm_sums(
    z: torch.Tensor,
    members: torch.Tensor,
    values: torch.Tensor,
    index: torch.Tensor,
    chosen: torch.Tensor,
    attended: torch.Tensor,
    *,
    bin_size: int,
    n_bins: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The three matrices of CSM_KINDS for one layer of one batch: all pairs of P, the attended
    pairs of H, the noise pairs of H (similar, not attended). Returns sums ``[kind, head, bin, bin]``
    float64 and counts ``[kind, head, bin, bin]`` int64 (batch totals: the matrices are drawn, not
    given intervals, so they are not kept per replicate group)."""
    heads, n_pos = z.shape[1], z.shape[2]
    all_sums, all_counts = binned_pair_sums(z, members, bin_size=bin_size, n_bins=n_bins)
    # of the pairs of H: 0 attended, 1 noise (similar, not attended); 2 for pairs outside H
    kind = torch.where(chosen, torch.where(attended, 0, 1), 2)
    picked_sums, picked_counts = binned_selected_sums(values, index, kind, 2, n_pos, bin_size=bin_size, n_bins=n_bins)
    sums = torch.cat([all_sums[None], picked_sums])
    counts = torch.cat([all_counts.expand(1, heads, n_bins, n_bins), picked_counts])
    return sums, counts
