"""The pruning curves of ``headatlas prune`` on one plot (SPEC §9): every order, the objective's
increase over the intact model against the share of heads removed, with its 95% interval as a
band; random orders in grey; every layer reduced to one head (``one_per_layer``) a point. Drawn from a stored prune (``prune_curves``)."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from headatlas.service.reports.plots import new_figure

if TYPE_CHECKING:
    from headatlas.service.storage.effect_rows import StoredPrune

COLOURS = {"effect": "#1b6ca8", "importance": "#2a9d5b", "noise": "#c0392b"}


def figure_prune(prune: StoredPrune, *, title: str) -> Figure:
    at = {c: i for i, c in enumerate(prune.columns)}
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    orders = list(dict.fromkeys(r[at["order"]] for r in prune.rows))
    first_random = next((o for o in orders if o.startswith("random:")), None)
    for order in orders:
        mine = [r for r in prune.rows if r[at["order"]] == order]
        x = [r[at["fraction"]] for r in mine]
        y = [r[at["increase"]] for r in mine]
        lo, hi = [r[at["increase_lo"]] for r in mine], [r[at["increase_hi"]] for r in mine]
        if order == "one_per_layer":  # one step, not a curve: every layer reduced to one head, a point
            errors = None if None in (lo[-1], hi[-1]) else [[y[-1] - lo[-1]], [hi[-1] - y[-1]]]
            ax.errorbar(x[-1:], y[-1:], yerr=errors, fmt="D", color="#7b3fa0", label="one head per layer", ms=5)
            continue
        is_random = order.startswith("random:")
        colour = "#999999" if is_random else COLOURS.get(order, "#444444")
        label = "random" if order == first_random else None if is_random else order
        ax.plot(x, y, color=colour, lw=1.0 if is_random else 2.0, label=label)
        if not is_random and all(v is not None for v in (*lo, *hi)):
            ax.fill_between(x, lo, hi, color=colour, alpha=0.15, lw=0)
    meta = prune.meta
    ax.set_xlabel("share of heads removed (mean ablation)")
    ax.set_ylabel(f"increase of {meta['objective']} ({meta['unit']})")
    ax.axhline(0.0, color="#000000", lw=0.5)
    # each part of the claim on lines of its own, short enough for the figure's width
    claim = [textwrap.fill(part, 105) for part in str(meta["claim"]).split("; ")]
    ax.set_title("\n".join([title, *claim]), fontsize=7)
    ax.legend(frameon=False, fontsize=8)
    return fig
