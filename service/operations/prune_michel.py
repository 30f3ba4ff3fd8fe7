"""Michel et al. 2019's pruning questions ("Are Sixteen Heads Really Better than One?"), answered
from a run's pruning curves (SPEC §9):

- ``one_per_layer``: every layer reduced to its most important head (the head of largest
  mean-ablation effect, else of largest gradient importance; ties to the lower head), every other
  head removed at once by mean ablation: one step of its own, a row of the prune's curves;
- ``until``: how many heads can go before the objective rises by X (in the objective's units, or a
  share of the gap between the intact model and every head removed), read off a stored curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from headatlas.service.errors import Param, ParameterError

if TYPE_CHECKING:
    from headatlas.service.storage.effect_rows import StoredPrune

Head = tuple[int, int]
ONE_PER_LAYER = "one_per_layer"


def one_per_layer(effect: np.ndarray | None, importance: np.ndarray | None) -> tuple[list[Head], str] | None:
    """The head each layer keeps (its largest ``effect``, else ``importance``, ``[layer, head]``;
    ties: the lower head) and what chose it; None where neither is known."""
    scores, basis = (effect, "mean-ablation effect") if effect is not None else (importance, "gradient importance")
    if scores is None:
        return None
    return [(layer, int(np.argmax(scores[layer]))) for layer in range(scores.shape[0])], basis


def one_per_layer_text(kept: list[Head], basis: str, increase: tuple[float, float, float], unit: str) -> str:
    """The one-head-per-layer experiment in words: which heads are kept and what the objective rises by."""
    value, lo, hi = increase
    bounds = "" if math.isnan(lo) or math.isnan(hi) else f" [{lo:+.4g}, {hi:+.4g}]"
    heads = " ".join(f"{layer}.{head}" for layer, head in kept)
    return (
        f"one_per_layer (each layer keeps only its head of largest {basis}: {heads}): "
        f"the objective rises by {value:+.4g} {unit}{bounds}"
    )


@dataclass(frozen=True)
class Until:
    """How many heads of ``order`` can go before the objective rises by ``limit`` (in ``unit``):
    the last step of the curve before the first whose increase's upper bound (``bound``: "upper
    bound", or "point estimate" where the curve has no intervals) exceeds it."""

    order: str
    limit: float
    asked: str  # as given: 0.05 or 10%
    unit: str
    bound: str
    step: int
    heads_removed: int
    total: int
    increase: tuple[float, float | None, float | None]
    heads: list[str]  # layer.head, removed by this step, sorted
    next_step: tuple[int, float, float | None, float | None] | None  # heads removed, increase, lo, hi

    def text(self) -> str:
        """One line: the answer, the step after it, and the heads."""

        def shown(value: float, lo: float | None, hi: float | None) -> str:
            return f"{value:+.4g}" + ("" if lo is None or hi is None else f" [{lo:+.4g}, {hi:+.4g}]")

        said = (
            f"until {self.limit:+.4g} {self.unit}"
            + (f" ({self.asked} of the rise with every head removed)" if self.asked.endswith("%") else "")
            + f", by the increase's {self.bound}: the {self.order} order removes {self.heads_removed} of "
            f"{self.total} heads (step {self.step}, increase {shown(*self.increase)})"
        )
        if self.next_step is not None:
            n, value, lo, hi = self.next_step
            said += f"; the next step ({n} heads) rises by {shown(value, lo, hi)}"
        else:
            said += "; every step stays within it"
        return said + (f"; removed: {' '.join(self.heads)}" if self.heads else "; none removed")


def parse_until(until: str | float) -> tuple[float, bool]:
    """``0.05`` → (0.05, False), ``10%`` → (0.1, True): X in the objective's units, or a share of
    the rise with every head removed. Refused: not a number, or below 0."""
    raw = until.strip() if isinstance(until, str) else until
    share = isinstance(raw, str) and raw.endswith("%")
    try:
        value = float(raw[:-1]) / 100 if share and isinstance(raw, str) else float(raw)
    except ValueError:
        raise ParameterError(
            Param("until", until, quoted=True), ": a rise of the objective, e.g. 0.05 (its units) or 10% (of the gap)"
        ) from None
    if not math.isfinite(value) or value < 0:
        raise ParameterError(Param("until", until, quoted=True), ": a rise of 0 or more")
    return value, share


def chosen_order(held: list[str], named: list[str] | None) -> str:
    """The curve ``until`` reads: the first of ``named`` (``--order``) the prune holds (``random``:
    its first seed), else ``effect``, else ``importance``."""
    wanted = [("random:0" if o == "random" else o) for o in (named or [])] or ["effect", "importance"]
    found = next((o for o in wanted if o in held and o != ONE_PER_LAYER), None)
    if found is None:
        raise ParameterError(
            Param("until", True),
            f": needs the {' or '.join(wanted)} order's curve; the prune holds {', '.join(held)}",
        )
    return found


def until(
    columns: list[str],
    rows: list[tuple],
    removed: list[str],
    *,
    limit: str | float,
    unit: str,
    order: str,
) -> Until:
    """Read ``limit`` off the stored curve of ``order`` (``rows`` of CURVE_COLUMNS, ``removed``
    per row): the largest number of heads removed such that every step up to it has its increase's
    upper bound ≤ X (the point estimate where the curve has no interval), X = ``limit`` in the
    objective's units or, as a percentage, that share of the increase with every head removed."""
    at = {c: i for i, c in enumerate(columns)}
    mine = sorted(
        ((r, heads) for r, heads in zip(rows, removed, strict=True) if r[at["order"]] == order),
        key=lambda pair: pair[0][at["step"]],
    )
    if not mine:
        raise ParameterError(Param("until", limit, quoted=True), f": the prune has no {order} curve")
    value, share = parse_until(limit)
    last = mine[-1][0]
    x = value * last[at["increase"]] if share else value
    bounded = all(r[at["increase_hi"]] is not None and not _nan(r[at["increase_hi"]]) for r, _ in mine)
    reads = "increase_hi" if bounded else "increase"
    chosen = 0
    for i, (r, _heads) in enumerate(mine):
        if r[at[reads]] > x:
            break
        chosen = i
    row = mine[chosen][0]
    heads = sorted(
        (h for _r, step_heads in mine[: chosen + 1] for h in (step_heads or "").split()),
        key=lambda h: tuple(int(p) for p in h.split(".")),
    )
    following = mine[chosen + 1][0] if chosen + 1 < len(mine) else None
    total = int(round(last[at["heads_removed"]]))

    def bounds(r: tuple) -> tuple[float | None, float | None]:
        lo, hi = r[at["increase_lo"]], r[at["increase_hi"]]
        return (None, None) if lo is None or hi is None or _nan(lo) or _nan(hi) else (lo, hi)

    return Until(
        order=order,
        limit=x,
        asked=str(limit) if isinstance(limit, str) else f"{limit:g}",
        unit=unit,
        bound="upper bound" if bounded else "point estimate (no intervals)",
        step=int(row[at["step"]]),
        heads_removed=int(row[at["heads_removed"]]),
        total=total,
        increase=(row[at["increase"]], *bounds(row)),
        heads=heads,
        next_step=None
        if following is None
        else (int(following[at["heads_removed"]]), following[at["increase"]], *bounds(following)),
    )


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


def until_of(saved: StoredPrune, limit: str | float, orders: Sequence[str] | None = None) -> Until:
    """``until`` on a stored prune: the curve of the first of ``orders`` it holds, else effect,
    else importance (``chosen_order``)."""
    at = saved.columns.index("order")
    held = list(dict.fromkeys(str(r[at]) for r in saved.rows))
    order = chosen_order(held, None if orders is None else list(orders))
    return until(saved.columns, saved.rows, saved.removed, limit=limit, unit=str(saved.meta["unit"]), order=order)
