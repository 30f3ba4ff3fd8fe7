"""The figure of a training series (``headatlas plot trend``): per metric a panel of lines, one
per head (colour by layer, one line style per head), against the training step on a symmetric
log axis (step 0 included) or a linear one, with each value's 95% interval as a band where the metric has one
(the probe's scores have none) and each metric's largest rise between two checkpoints — its
phase change, ``series_queries.phases`` — marked by a dashed line at the step it ends on.
Drawn from the rows ``query trend --series`` and ``query phases`` return. Layers and heads are
0-based. Import lazily (matplotlib).
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from sqlalchemy.engine import Connection

from headatlas.service.reports import plots
from headatlas.service.reports.columns import PROBE_COLUMNS
from headatlas.service.reports.series_queries import largest_phases, phases, trend

STYLES = ("-", "--", ":", "-.")


def figure_trend(
    conn: Connection, series: str, metrics: tuple[str, ...], *, layer: int | None = None, linear: bool = False
) -> Figure:
    """One panel per metric of ``metrics`` (module docstring); ``linear``: the step axis linear
    (a phase change late in training drawn wide) rather than logarithmic past step 1."""
    fig = plots.new_figure(5.2 * len(metrics) + 1.0, 4.6)
    axes = fig.subplots(1, len(metrics), squeeze=False)[0]
    rises = largest_phases(phases(conn, series, metrics=metrics, layer=layer))
    cmap = plots.matplotlib.colormaps["viridis"]
    banded = False
    for ax, metric in zip(axes, metrics, strict=True):
        columns, rows = trend(conn, series, metric=metric, layer=layer, ci=metric not in PROBE_COLUMNS)
        at = {c: i for i, c in enumerate(columns)}
        layers = sorted({r[at["layer"]] for r in rows})
        for lay, hd in sorted({(r[at["layer"]], r[at["head"]]) for r in rows}):
            mine = [r for r in rows if r[at["layer"]] == lay and r[at["head"]] == hd]
            step = np.array([r[at["step"]] for r in mine], dtype=float)
            value = np.array([np.nan if r[at[metric]] is None else r[at[metric]] for r in mine], dtype=float)
            colour = cmap(0.85 * layers.index(lay) / max(1, len(layers) - 1))
            ax.plot(step, value, STYLES[hd % len(STYLES)], color=colour, marker="o", ms=3, lw=1.4, label=f"L{lay}H{hd}")
            if f"{metric}_lo" in at:
                lo = np.array([np.nan if r[at[f"{metric}_lo"]] is None else r[at[f"{metric}_lo"]] for r in mine])
                hi = np.array([np.nan if r[at[f"{metric}_hi"]] is None else r[at[f"{metric}_hi"]] for r in mine])
                ax.fill_between(step, lo.astype(float), hi.astype(float), color=colour, alpha=0.18, lw=0)
                banded = True
        rise = rises.get(metric)
        if rise is not None:
            ax.axvline(rise.step_after, color="0.35", ls="--", lw=1)
            ax.annotate(
                f"L{rise.layer}H{rise.head}: {rise.before:.2f} → {rise.after:.2f}\nfrom step {rise.step_before} to {rise.step_after}",
                xy=(0.03, 0.97),
                xycoords="axes fraction",
                ha="left",
                va="top",
                fontsize=8,
            )
        last = max((r[at["step"]] for r in rows), default=1)
        if linear:
            ax.set_xlim(0, max(1, last) * 1.03)
        else:
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xlim(-0.2, max(2, last) * 1.5)  # step 0 at the left edge, room after the last step
        ax.set_xlabel("training step")
        ax.set_title(metric, fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8, title="layer, head")
    note = "dashed: the largest rise between two checkpoints (phase change)"
    if banded:
        note += "; bands: 95% jackknife intervals (SPEC §5d)"
    plots.suptitle(fig, f"series {series} · {note}", fontsize=10)
    return fig
