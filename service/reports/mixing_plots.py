"""Figures of the mixing measures (SPEC §6): where each layer's outputs draw from, per method, and
how far a method's rows are from the heads' attention rows.

Drawn from the rows of ``mixing_queries.mixing``, ``mixing_queries.discrepancy`` and
``mixing_queries.discrepancy_layers`` (the numbers of ``headatlas query mixing`` / ``discrepancy``), with
``service.reports.plots``' figure conventions. Layers and heads are 0-based.
"""

from __future__ import annotations

import matplotlib
import numpy as np

from headatlas.service.errors import ParameterError
from headatlas.service.reports import mixing_queries
from headatlas.service.reports.plots import _col, _title, new_figure

MIXING_FIGSIZE = (15.0, 4.5)
DISCREPANCY_FIGSIZE = (14.0, 5.5)
# the measures drawn, with what a panel says; mean_distance stays in the table
MIXING_PANELS = (
    ("self", "mass to the token itself"),
    ("neighbours", "mass to the previous and next token"),
    ("specials", "mass to [CLS] and [SEP]"),
    ("punctuation", "mass to . and ,"),
)
METHOD_STYLE = {
    "attention": ("black", "o-"),
    "attribution": ("C3", "s-"),
    "rollout": ("C0", "^-"),
    "norm": ("C2", "v-"),
    "alti": ("C4", "D-"),
}


def figure_mixing(columns: list[str], rows: list[tuple], *, title: str):
    """Per layer, the share of each output's mixture that comes from itself, its neighbours, the
    special tokens and punctuation: one panel per target, one line per method."""
    fig = new_figure(*MIXING_FIGSIZE)
    axes = fig.subplots(1, len(MIXING_PANELS), sharex=True)
    methods = [c for c in columns if c not in ("layer", "head", "measure")]
    mi = columns.index("measure")
    for ax, (measure, name) in zip(axes, MIXING_PANELS):
        mine = [r for r in rows if r[mi] == measure]
        layer = _col(columns, mine, "layer")
        for method in methods:
            colour, fmt = METHOD_STYLE.get(method, ("C7", "o-"))
            ax.plot(layer, _col(columns, mine, method), fmt, color=colour, ms=4, label=method)
        ax.set(title=name, xlabel="layer", xticks=layer)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("mean share of a row's mass")
    axes[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.supxlabel(
        "layer-level rows: mean attention of the heads, and each method's mixture of the whole layer (SPEC §6)",
        fontsize=8,
    )
    return fig


def figure_discrepancy(
    head_columns, head_rows, layer_columns, layer_rows, *, method: str, n_layers: int, n_heads: int, title: str
):
    """Left: per head, the mean Jensen–Shannon divergence between ``method``'s rows and the head's
    attention rows (bits; 0 = the same distribution, 1 = disjoint). Right: the layer progression —
    the heads' mean with their range, and the layer-level rows' divergence."""
    grid = np.full((n_layers, n_heads), np.nan)
    li, hi, ji = (head_columns.index(c) for c in ("layer", "head", "jsd"))
    for r in head_rows:
        grid[r[li], r[hi]] = np.nan if r[ji] is None else r[ji]
    fig = new_figure(*DISCREPANCY_FIGSIZE)
    heat_ax, line_ax = fig.subplots(1, 2, width_ratios=(1.2, 1))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#dddddd")
    image = heat_ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto", vmin=0)
    fig.colorbar(image, ax=heat_ax, label=f"JSD(attention, {method}), bits")
    if n_heads <= 16 and n_layers <= 24:
        for (l, h), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax_colour = "white" if v < np.nanmax(grid) * 0.6 else "black"
                heat_ax.text(h, l, f"{v:.2f}", ha="center", va="center", fontsize=7, color=ax_colour)
    heat_ax.set(
        xticks=range(n_heads),
        yticks=range(n_layers),
        xlabel="head",
        ylabel="layer",
        title=f"per head: attention vs {method}",
    )
    layer = _col(layer_columns, layer_rows, "layer")
    line_ax.fill_between(
        layer,
        _col(layer_columns, layer_rows, "min_head_jsd"),
        _col(layer_columns, layer_rows, "max_head_jsd"),
        color="C0",
        alpha=0.2,
        label="range over the layer's heads",
    )
    line_ax.plot(layer, _col(layer_columns, layer_rows, "mean_head_jsd"), "o-", color="C0", label="mean over heads")
    line_ax.plot(
        layer,
        _col(layer_columns, layer_rows, "layer_jsd"),
        "s--",
        color="C3",
        label="layer-level rows (mean attention)",
    )
    line_ax.set(
        xlabel="layer",
        ylabel="JSD, bits",
        xticks=layer,
        ylim=(0, None),
        title=f"layer progression: attention vs {method}",
    )
    line_ax.grid(alpha=0.3)
    line_ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig, grid


def run_mixing(conn, run, *, methods: list[str] | None = None):
    """``plot mixing`` for ``run`` (a store ``Run``)."""
    return figure_mixing(*mixing_queries.mixing(conn, run.run_id, methods=methods), title=_title(run))


def run_discrepancy(conn, run, *, method: str = "attribution"):
    """``plot discrepancy`` for ``run``: returns (figure, the drawn layer × head grid)."""
    if method == "attention":
        raise ParameterError(
            "--method attention: attention against itself is 0 everywhere; choose attribution, rollout, norm or alti"
        )
    head_columns, head_rows = mixing_queries.discrepancy(conn, run.run_id, method=method)
    layer_columns, layer_rows = mixing_queries.discrepancy_layers(conn, run.run_id, method=method)
    return figure_discrepancy(
        head_columns,
        head_rows,
        layer_columns,
        layer_rows,
        method=method,
        n_layers=run.n_layers,
        n_heads=run.n_heads,
        title=_title(run),
    )
