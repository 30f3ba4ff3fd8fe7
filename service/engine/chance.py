"""Head-independent chance statistics of a batch (SPEC §5, §5b, §8): what a head's sums are
compared against.

Pure tensor code: imports neither Celery, Typer nor SQLAlchemy. Shape names as in
``service.engine.features``.
"""

from __future__ import annotations

import torch

from headatlas.service.engine.features import WindowFeatures, count_true


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
    next_rows = torch.zeros_like(feats.n) if feats.causal else count_true(valid[:, 1:] & valid[:, :-1], dim=1)
    return {
        "windows": reduce(torch.ones(batch, dtype=torch.long, device=pair_ok.device)),
        "pairs": reduce(feats.n_pairs),
        "same_sentence_pairs": reduce(count_true(feats.same_sentence, dim=1)),
        "same_token_pairs": reduce(count_true(feats.same_token, dim=1)),
        "attn_rows": reduce(feats.n),
        "same_word_pairs": reduce(count_true(feats.same_word, dim=1)),
        "punct_tokens": reduce(count_true(feats.key_classes[:, :, 2], dim=1)),
        # SPEC §8: uniform attention over each row's visible keys, summed over valid rows
        "uniform_cls": reduce(uniform_weight(seen[..., 0], feats)),
        "uniform_sep": reduce(uniform_weight(seen[..., 1], feats)),
        "uniform_punct": reduce(uniform_weight(seen[..., 2], feats)),
        "uniform_first": reduce(uniform_weight(seen[..., 3], feats)),
        "next_rows": reduce(next_rows),
        "dup_rows": reduce(count_true(copies[..., 0] > 0, dim=1)),
        "attn_dup_chance": reduce(uniform_weight(copies[..., 0], feats)),
        "induction_rows": reduce(count_true(copies[..., 1] > 0, dim=1)),
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
