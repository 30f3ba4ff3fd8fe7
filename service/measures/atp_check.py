"""Attribution patching checked against exact mean ablation (SPEC §9).

``atp`` is a screen: every head's first-order estimate of its mean-ablation effect from one forward
and one backward pass (``effects.head_effects``). Its check measures what it screens for: every
head mean-ablated exactly on the same windows against the same reference means, then

- Spearman's ρ (average ranks for ties) between the two across all heads, each head's effect the
  mean over the windows (what a run stores);
- the top-k recall: of the k heads with the largest exact |effect|, the share among the k with the
  largest |AtP| (magnitude: a head whose removal helps the model matters as much as one whose
  removal hurts it);
- AtP's top k, each with its estimate and its exact effect.

Pure computation: imports neither Celery, Typer nor SQLAlchemy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from headatlas.service.engine.model import LoadedModel
from headatlas.service.errors import Param, ParameterError
from headatlas.service.measures.objectives import Objective

CHUNK = 8  # windows ablated together (the stacked pass holds heads × windows copies)


@dataclass(frozen=True)
class AtpCheck:
    """AtP against exact mean ablation over ``heads`` heads (the module docstring). ``top``: AtP's
    top ``k`` by |estimate|, each ``(layer, head, atp, exact)``, largest first."""

    k: int
    heads: int
    spearman: float
    recall: float
    top: tuple[tuple[int, int, float, float], ...]

    def describe(self, unit: str = "") -> str:
        unit = f" {unit}" if unit else ""
        heads = ", ".join(f"{layer}.{head} {exact:+.3g}{unit} (AtP {atp:+.3g})" for layer, head, atp, exact in self.top)
        return (
            f"AtP against exact mean ablation over {self.heads} heads: Spearman ρ = {self.spearman:.3f}, "
            f"top-{self.k} recall = {self.recall:.2f} (of the {self.k} heads with the largest exact |effect|, "
            f"the share among AtP's {self.k}); AtP's top {self.k}, exact effect (AtP): {heads}"
        )


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's ρ of two equal-length vectors (average ranks for ties); NaN where either is constant."""

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="mergesort")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):
            tied = v == value
            if tied.sum() > 1:
                r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(np.asarray(x, dtype=float)), ranks(np.asarray(y, dtype=float))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = math.sqrt(float((rx**2).sum() * (ry**2).sum()))
    return float((rx * ry).sum() / denominator) if denominator else math.nan


def _largest(values: np.ndarray, k: int) -> list[int]:
    """Flat indices of the ``k`` largest |values|, largest first (ties: the lower index first)."""
    return [int(i) for i in np.argsort(-np.abs(values), kind="mergesort")[:k]]


def compare(atp: np.ndarray, exact: np.ndarray, k: int) -> AtpCheck:
    """``atp`` against ``exact`` ``[layer, head]`` (each head's mean over the windows)."""
    atp, exact = np.asarray(atp, dtype=float), np.asarray(exact, dtype=float)
    if atp.shape != exact.shape or atp.ndim != 2:
        raise ValueError(f"AtP {atp.shape} and exact effects {exact.shape} must both be [layer, head]")
    n_heads = atp.shape[1]
    flat_atp, flat_exact = atp.ravel(), exact.ravel()
    if not 1 <= k <= flat_atp.size:
        raise ParameterError(Param("check_top", k), f": name 1 to {flat_atp.size} heads (the model's)")
    named = _largest(flat_atp, k)
    recall = len(set(named) & set(_largest(flat_exact, k))) / k
    top = tuple((i // n_heads, i % n_heads, float(flat_atp[i]), float(flat_exact[i])) for i in named)
    return AtpCheck(k, flat_atp.size, spearman(flat_atp, flat_exact), recall, top)


def atp_check(
    model: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    k: int,
    *,
    means: torch.Tensor | None = None,
    window_ids: list[str] | None = None,
    objective: Objective | None = None,
) -> AtpCheck:
    """AtP and exact mean ablation of every head on these windows (``means``: the reference means
    ``[layer, head, d_head]``; None: the mean over these windows' own valid positions), compared
    (``compare``). The model's objective must be a loss (``head_effects`` refuses a drift)."""
    from headatlas.service.measures import effects as fx

    if means is None:
        means, _ = fx.reference_means(model, [(input_ids, attention_mask)])
    totals: dict[str, torch.Tensor] = {}
    windows = 0
    for start in range(0, input_ids.shape[0], CHUNK):
        part = slice(start, start + CHUNK)
        got = fx.head_effects(
            model,
            input_ids[part],
            attention_mask[part],
            kinds=("mean", "atp"),
            means=means,
            window_ids=window_ids[part] if window_ids is not None else None,
            objective=objective,
        )
        ok = torch.isfinite(got.intact)  # a window whose objective is undefined is left out, as in a run
        for kind in ("mean", "atp"):
            totals[kind] = totals.get(kind, 0) + got.effect[kind][ok].sum(dim=0)
        windows += int(ok.sum())
    if not windows:
        raise ParameterError("no window has an objective to check AtP on (a window of one token has no next token)")
    return compare((totals["atp"] / windows).numpy(), (totals["mean"] / windows).numpy(), k)
