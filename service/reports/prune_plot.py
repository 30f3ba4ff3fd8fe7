"""The pruning curves of ``headatlas prune`` on one plot (SPEC §9): every order, the objective's
increase over the intact model against the share of heads removed, with its 95% interval as a
band; random orders in grey; every layer reduced to one head (``one_per_layer``) a point. Drawn from a stored prune (``prune_curves``).
And a memory curve of ``prune --streaming`` (SPEC §10) the same way, against the KV cache saved."""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from headatlas.service.reports.plots import new_figure

if TYPE_CHECKING:
    from headatlas.service.storage.effect_rows import StoredPrune
    from headatlas.service.storage.streaming_curve_rows import StoredMemoryCurve

COLOURS = {
    "effect": "#1b6ca8",
    "importance": "#2a9d5b",
    "noise": "#c0392b",
    "beyond": "#2a9d5b",  # a memory curve's orders (SPEC §10)
    "long_range": "#e08e0b",
    "layer": "#7b3fa0",
    "sinks": "#8c564b",
}


def figure_prune(prune: StoredPrune, *, title: str) -> Figure:
    at = {c: i for i, c in enumerate(prune.columns)}
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    _draw_orders(ax, prune.rows, at, x="fraction")
    meta = prune.meta
    ax.set_xlabel("share of heads removed (mean ablation)")
    ax.set_ylabel(f"increase of {meta['objective']} ({meta['unit']})")
    ax.axhline(0.0, color="#000000", lw=0.5)
    # each part of the claim on lines of its own, short enough for the figure's width
    claim = [textwrap.fill(part, 105) for part in str(meta["claim"]).split("; ")]
    ax.set_title("\n".join([title, *claim]), fontsize=7)
    ax.legend(frameon=False, fontsize=8)
    return fig


def figure_memory(curve: StoredMemoryCurve, *, title: str, said: str, max_loss: float) -> Figure:
    """A memory curve (SPEC §10): each order's increase of the objective against the share of the
    KV cache saved, with its interval as a band, random orders in grey, the loss budget a dashed
    line; ``said``: the headline, under the title."""
    at = {c: i for i, c in enumerate(curve.columns)}
    fig = new_figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    _draw_orders(ax, curve.rows, at, x="memory_share")
    meta = curve.meta
    ax.set_xlabel(
        f"share of the KV cache saved (S = {meta['sink']}, W = {meta['recent']}, n = {meta['seq_len']}; "
        f"full: {int(meta['full_cache']):,} bytes a sequence)"
    )
    ax.set_ylabel(f"increase of {meta['objective']} ({meta['unit']})")
    ax.axhline(0.0, color="#000000", lw=0.5)
    ax.axhline(max_loss, color="#000000", lw=0.8, ls="--")
    ax.set_title("\n".join([title, textwrap.fill(said, 105)]), fontsize=7)
    ax.legend(frameon=False, fontsize=8)
    return fig


def _draw_orders(ax, rows: list[tuple], at: dict[str, int], *, x: str) -> None:
    """Every order's increase against column ``x``, its interval a band; random orders in grey;
    ``one_per_layer`` (one step) a point."""
    orders = list(dict.fromkeys(r[at["order"]] for r in rows))
    first_random = next((o for o in orders if o.startswith("random:")), None)
    for order in orders:
        mine = [r for r in rows if r[at["order"]] == order]
        xs = [r[at[x]] for r in mine]
        y = [r[at["increase"]] for r in mine]
        lo, hi = [r[at["increase_lo"]] for r in mine], [r[at["increase_hi"]] for r in mine]
        if order == "one_per_layer":  # one step, not a curve: every layer reduced to one head, a point
            errors = None if None in (lo[-1], hi[-1]) else [[y[-1] - lo[-1]], [hi[-1] - y[-1]]]
            ax.errorbar(xs[-1:], y[-1:], yerr=errors, fmt="D", color="#7b3fa0", label="one head per layer", ms=5)
            continue
        is_random = order.startswith("random:")
        colour = "#999999" if is_random else COLOURS.get(order, "#444444")
        label = "random" if order == first_random else None if is_random else order
        ax.plot(xs, y, color=colour, lw=1.0 if is_random else 2.0, label=label)
        if not is_random and all(v is not None for v in (*lo, *hi)):
            ax.fill_between(xs, lo, hi, color=colour, alpha=0.15, lw=0)
