"""The pruning curves of ``headatlas prune`` on one plot (SPEC §9): every order, the objective's
increase over the intact model against the share of heads removed, with its 95% interval as a band; random orders in grey."""

from __future__ import annotations

from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from headatlas.service.reports.plots import new_figure

if TYPE_CHECKING:
    from headatlas.service.engine.pruning import PruneResult

COLOURS = {"effect": "#1b6ca8", "importance": "#2a9d5b", "noise": "#c0392b"}


def figure_prune(result: PruneResult) -> Figure:
    columns, rows = result.rows()
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    for curve in result.curves:
        mine = [r for r in rows if r[0] == curve.order]
        x = [r[3] for r in mine]
        y, lo, hi = [r[7] for r in mine], [r[8] for r in mine], [r[9] for r in mine]
        is_random = curve.order.startswith("random:")
        colour = "#999999" if is_random else COLOURS.get(curve.order, "#444444")
        label = "random" if curve.order == "random:0" else None if is_random else curve.order
        ax.plot(x, y, color=colour, lw=1.0 if is_random else 2.0, label=label)
        if not is_random:
            ax.fill_between(x, lo, hi, color=colour, alpha=0.15, lw=0)
    ax.set_xlabel("share of heads removed (mean ablation)")
    ax.set_ylabel(f"increase of {result.objective} ({result.unit})")
    ax.axhline(0.0, color="#000000", lw=0.5)
    claim = result.claim().split("; ")
    ax.set_title("\n".join([f"pruning curves: {result.model}", *claim]), fontsize=7)
    ax.legend(frameon=False, fontsize=8)
    return fig
