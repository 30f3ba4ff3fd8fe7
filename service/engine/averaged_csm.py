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
    values: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, n_pos: int, *, bin_size: int, n_bins: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ over the batch of C_ij and the count of the pairs marked by ``mask``, by bin.

    values, index (i·pos + j, i < j), mask: ``[batch, head, k]`` as ``select_pairs`` ranks them.
    Returns sums ``[head, bin, bin]`` float64 and counts ``[head, bin, bin]`` int64.
    """
    heads = index.shape[1]
    cell = (index // n_pos // bin_size) * n_bins + (index % n_pos) // bin_size  # [batch, head, k]
    cell = cell.transpose(0, 1).reshape(heads, -1)
    picked = torch.where(mask, values, 0.0).double().transpose(0, 1).reshape(heads, -1)
    sums = torch.zeros(heads, n_bins * n_bins, dtype=torch.float64, device=index.device)
    counts = torch.zeros(heads, n_bins * n_bins, dtype=torch.long, device=index.device)
    sums.scatter_add_(1, cell, picked)
    counts.scatter_add_(1, cell, mask.transpose(0, 1).reshape(heads, -1).long())
    return sums.view(heads, n_bins, n_bins), counts.view(heads, n_bins, n_bins)


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
    attended = attended & chosen
    noise = chosen & ~attended
    att_sums, att_counts = binned_selected_sums(values, index, attended, n_pos, bin_size=bin_size, n_bins=n_bins)
    noise_sums, noise_counts = binned_selected_sums(values, index, noise, n_pos, bin_size=bin_size, n_bins=n_bins)
    sums = torch.stack([all_sums, att_sums, noise_sums])
    counts = torch.stack([all_counts.expand(heads, n_bins, n_bins), att_counts, noise_counts])
    return sums, counts
