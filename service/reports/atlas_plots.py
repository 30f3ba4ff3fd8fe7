"""Figures of the head atlas and of two runs compared (SPEC §7; ``service.reports.compare``).

Drawn from the rows of ``service.reports.roles`` and ``service.reports.compare`` (the numbers of ``headatlas
query roles`` and ``headatlas compare``), with ``service.reports.plots``' figure conventions: fixed
sizes in inches, no pyplot, PNG or SVG by suffix. Layers and heads are 0-based.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib import colors
from matplotlib.patches import Patch, Rectangle

from headatlas.service.errors import ParameterError
from headatlas.service.metrics import chance_centre
from headatlas.service.reports import attention_kind, compare, role_rules, role_views, roles
from headatlas.service.reports.plots import _col, _err, _title, interval_caption, new_figure, suptitle

ROLE_COLOURS = {
    "previous-token": "#1f77b4",
    "next-token": "#17becf",
    "induction": "#393b79",
    "duplicate-token": "#e7ba52",
    "repetition": "#d62728",
    "sentence-bound": "#2ca02c",
    "punctuation": "#9467bd",
    "local": "#ff7f0e",
    "[CLS] sink": "#8c564b",
    "first-token sink": "#c49c94",
    "[SEP] sink": "#e377c2",
    "broad": "#bcbd22",
    role_rules.NONE: "#e4e4e4",
}
ROLE_CODES = {
    "previous-token": "P",
    "next-token": "N",
    "induction": "I",
    "duplicate-token": "D",
    "repetition": "R",
    "sentence-bound": "S",
    "punctuation": "U",  # a letter: a "." beside another code read as an abbreviation ("P.")
    "local": "L",
    "[CLS] sink": "C",
    "first-token sink": "F",
    "[SEP] sink": "E",
    "broad": "B",
    role_rules.NONE: "",
}
ATLAS_ROLES = (*role_rules.ROLE_ORDER, role_rules.NONE)
UNSTABLE_HATCH = "////"
UNSTABLE_MARK = "?"  # after a role's letter: the role does not hold on both halves


def atlas_size(n_layers: int, n_heads: int) -> tuple[float, float]:
    """Inches (whole quarters, so pixel and point sizes are exact): cells stay about 0.6 × 0.45 in,
    with room for the legend on the right."""
    return _quarter(max(8.0, 3.6 + 0.62 * n_heads)), _quarter(max(4.5, 1.6 + 0.45 * n_layers))


def _quarter(inches: float) -> float:
    return math.ceil(inches * 4) / 4


def figure_atlas(
    columns: list[str],
    rows: list[tuple],
    *,
    n_layers: int,
    n_heads: int,
    title: str,
    offered: tuple[str, ...] | None = None,
    shade: tuple[str, np.ndarray] | None = None,
) -> tuple:
    """Layer × head grid coloured by each head's primary role; each cell lists the codes of every
    role the head holds (legend: code and colour). Where ``rows`` carry stability (``query roles
    --stability``), a cell whose primary role does not hold on both halves is hatched and an
    unstable role's code is followed by ``?``. ``offered``: the run's roles (``role_rules.offered_roles``),
    the legend's entries; default every role. ``shade``: (metric, ``[layer, head]`` values) colours
    the cells by that metric (e.g. ``effect_mean``, SPEC §9) instead of the role, the role codes
    written over it. Returns (figure, role index grid)."""
    grid = role_views.primary_grid(columns, rows, n_layers, n_heads)
    index = np.full((n_layers, n_heads), np.nan)
    for (l, h), _ in np.ndenumerate(index):
        if grid[l][h] is not None:
            index[l, h] = ATLAS_ROLES.index(grid[l][h])
    held: dict[tuple[int, int], list[str]] = {}
    unstable: set[tuple[int, int, str]] = set()
    li, hi, ri = (columns.index(c) for c in ("layer", "head", "role"))
    si = columns.index("stable") if "stable" in columns else None
    for r in rows:
        held.setdefault((r[li], r[hi]), []).append(r[ri])
        if si is not None and r[ri] != role_rules.NONE and r[si] is False:
            unstable.add((r[li], r[hi], r[ri]))
    fig = new_figure(*atlas_size(n_layers, n_heads))
    ax = fig.subplots()
    cmap = colors.ListedColormap([ROLE_COLOURS[r] for r in ATLAS_ROLES]).with_extremes(bad="#ffffff")
    norm = colors.BoundaryNorm(np.arange(len(ATLAS_ROLES) + 1) - 0.5, len(ATLAS_ROLES))
    if shade is None:
        ax.imshow(np.ma.masked_invalid(index), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    else:
        metric, values = shade
        image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", aspect="auto", interpolation="nearest")
        fig.colorbar(image, ax=ax, label=metric, location="left")
    for l, h, role in sorted(unstable):
        if grid[l][h] == role:
            ax.add_patch(
                Rectangle((h - 0.5, l - 0.5), 1, 1, fill=False, hatch=UNSTABLE_HATCH, edgecolor="#ffffff", lw=0)
            )
    for (l, h), codes in held.items():
        label = "".join(ROLE_CODES[c] + (UNSTABLE_MARK if (l, h, c) in unstable else "") for c in codes)
        if label:
            dark = grid[l][h] in (
                "previous-token",
                "induction",
                "repetition",
                "sentence-bound",
                "punctuation",
                "[CLS] sink",
            )
            if shade is not None:  # viridis: light cells at the top of the scale
                value, top = shade[1][l, h], np.nanmax(shade[1])
                low = np.nanmin(shade[1])
                dark = not (np.isfinite(value) and top > low and (value - low) / (top - low) > 0.6)
            ax.text(
                h,
                l,
                label,
                ha="center",
                va="center",
                fontsize=8 if n_heads <= 16 else 6,
                color="white" if dark else "black",
                fontweight="bold",
            )
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xticks(np.arange(n_heads + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(n_layers + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    # the title and the legend name what the colour is: the primary role, or the metric shaded
    # (its scale in the colour bar; the letters still list every role held)
    coloured = "primary role" if shade is None else shade[0]
    ax.set(xlabel="head", ylabel="layer", title=f"{coloured} per head (letters: every role held)")
    listed = role_rules.ROLE_ORDER if offered is None else offered
    counts = role_views.role_counts(columns, rows, listed)
    stable = role_views.stable_counts(columns, rows)
    handles = [
        Patch(
            facecolor=ROLE_COLOURS[r] if shade is None else "none",
            edgecolor="#999999",
            label=f"{ROLE_CODES[r] or '–'}  {r} ({counts[r]}"
            + (f", {stable[r]} stable" if stable is not None and r in stable else "")
            + ")",
        )
        for r in ATLAS_ROLES
        if r in counts
    ]
    if stable is not None:
        handles.append(
            Patch(
                facecolor="#bbbbbb",
                edgecolor="#999999",
                hatch=UNSTABLE_HATCH,
                label=f"hatched, {UNSTABLE_MARK}: not held on both halves",
            )
        )
    fig.legend(
        handles=handles,
        loc="outside right center",
        fontsize=8,
        title="role (heads holding it)" if shade is None else f"letters: role (heads holding it)\ncolour: {shade[0]}",
        title_fontsize=8,
        frameon=False,
    )
    suptitle(fig, title)
    fig.supxlabel(
        # two lines: one ran past the edges of the narrowest atlas (8 inches)
        "a role: its one-sided jackknife t test rejects after Holm–Bonferroni over every (head, role) of the run\n"
        "(SPEC §7); halves: alternate replicate groups",
        fontsize=8,
    )
    return fig, index


def run_atlas(conn, run, *, colour: str | None = None) -> tuple:
    """The atlas of ``run`` (a store ``Run``) from ``roles.roles``, unstable roles marked;
    ``colour``: a column of ``query heads`` (``effect_mean``: what removing each head costs) to
    colour the cells by, instead of the role."""
    from sqlalchemy import text

    from headatlas.service.reports.columns import HEAD_COLUMNS, unknown_metric

    columns, rows = roles.roles(conn, run.run_id, stability=True)
    offered = role_rules.offered_roles(attention_kind.causal_run(conn, run.run_id))
    shade = None
    if colour is not None:
        if colour not in HEAD_COLUMNS[2:-1]:
            raise unknown_metric("colour", colour, HEAD_COLUMNS[2:-1])
        values = np.full((run.n_layers, run.n_heads), np.nan)
        for layer, head, value in conn.execute(
            text(f"SELECT layer, head, {colour} FROM head_metrics WHERE run_id = :r"), {"r": run.run_id}
        ):
            values[layer, head] = np.nan if value is None else value
        if np.isnan(values).all():
            from headatlas.service.errors import ParameterError

            raise ParameterError(f"--colour {colour}: run {run.run_id} has no value of it (effects: analyze --effects)")
        shade = (colour, values)
    return figure_atlas(
        columns, rows, n_layers=run.n_layers, n_heads=run.n_heads, title=_title(run), offered=offered, shade=shade
    )


# --- compare ------------------------------------------------------------------------------------
def compare_size(panels: int) -> tuple[float, float]:
    return 15.0, _quarter(0.8 + 3.6 * math.ceil(panels / 3))


def figure_compare(
    profile_a,
    profile_b,
    *,
    metrics: list[str],
    labels: tuple[str, str],
    depths: tuple[int, int],
    heat: tuple[str, np.ndarray, np.ndarray] | None,
    title: str,
    groups: list[int] | None = None,
):
    """One panel per metric: both runs' layer profiles with 95% intervals as error bars (x: layer,
    or relative depth (l + 0.5)/L when the depths differ); then the per-head A − B heat map of one
    metric (``heat`` = (metric, difference grid, beyond mask)), where both runs have one shape."""
    panels = len(metrics) + (heat is not None)
    fig = new_figure(*compare_size(panels))
    axes = np.atleast_1d(fig.subplots(math.ceil(panels / 3), 3)).ravel()
    same_depth = depths[0] == depths[1]
    for ax, metric in zip(axes, metrics):
        for (columns, rows), label, n, colour, marker in (
            (profile_a, labels[0], depths[0], "C0", "o-"),
            (profile_b, labels[1], depths[1], "C3", "s--"),
        ):
            layer = _col(columns, rows, "layer")
            x = layer if same_depth else (layer + 0.5) / n
            ax.errorbar(
                x,
                _col(columns, rows, metric),
                yerr=_err(columns, rows, metric),
                fmt=marker,
                color=colour,
                capsize=2,
                elinewidth=0.9,
                ms=4,
                label=label,
            )
        centre = chance_centre(metric)
        if centre is not None:
            ax.axhline(centre, color="black", ls=":", lw=1)
        ax.set_title(metric + _against(metric), fontsize=9)
        ax.set_xlabel("layer" if same_depth else "relative depth (l + 0.5) / L")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if heat is not None:
        metric, diff, beyond = heat
        ax = axes[len(metrics)]
        finite = diff[np.isfinite(diff)]
        top = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
        image = ax.imshow(np.ma.masked_invalid(diff), cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto")
        fig.colorbar(image, ax=ax, label=f"{metric}: A − B")
        for (l, h), flag in np.ndenumerate(beyond):
            if flag:
                ax.plot(h, l, marker="o", ms=3, color="black")
        ax.set(xlabel="head", ylabel="layer", title="A − B per head (dot: beyond the 95% interval)")
        ax.title.set_fontsize(9)
    for ax in axes[panels:]:
        ax.set_visible(False)
    suptitle(fig, title)
    fig.supxlabel(interval_caption(profile_a, profile_b, groups=groups) + "; dotted line: chance (1)", fontsize=8)
    return fig


def _against(metric: str) -> str:
    if metric.endswith("_lift_dm"):
        return " (vs distance-matched chance)"
    if metric.startswith("attn_") and metric.endswith("_lift"):
        return " (vs uniform attention)"
    if metric.endswith("_lift"):
        return " (vs chance: all pairs)"
    return ""


def run_compare(conn, run_a, run_b, *, metrics=None, heat_metric: str | None = None):
    """``plot compare``: the figure from ``compare.layer_profile`` and ``compare.compare``."""
    from headatlas.service.reports.intervals import groups_held

    chosen = compare.check_metrics(metrics)
    same_shape = (run_a.n_layers, run_a.n_heads) == (run_b.n_layers, run_b.n_heads)
    if heat_metric is not None and not same_shape:
        raise ParameterError(
            f"--heat-metric {heat_metric}: runs {run_a.name} ({run_a.n_layers}×{run_a.n_heads}) and {run_b.name} "
            f"({run_b.n_layers}×{run_b.n_heads}) differ in shape; the head heat map needs one shape: drop --heat-metric"
        )
    heat = None
    if same_shape:
        metric = compare.check_metrics([heat_metric or chosen[0]])[0]
        columns, rows = compare.compare(conn, run_a, run_b, metrics=[metric], heads=True)
        diff = np.full((run_a.n_layers, run_a.n_heads), np.nan)
        beyond = np.zeros_like(diff, dtype=bool)
        li, hi, di, vi = (columns.index(c) for c in ("layer_a", "head", "difference", "verdict"))
        for r in rows:
            diff[r[li], r[hi]] = np.nan if r[di] is None else r[di]
            beyond[r[li], r[hi]] = r[vi] == "beyond"
        heat = (metric, diff, beyond)
    label_b = f"B: {run_b.name}" + (" (control: the floor)" if compare.is_control(run_a, run_b) else "")
    title = (
        f"A = run {run_a.run_id} ({run_a.name}, {run_a.model_name}) vs B = run {run_b.run_id} "
        f"({run_b.name}, {run_b.model_name})"
    )
    return figure_compare(
        compare.layer_profile(conn, run_a, chosen),
        compare.layer_profile(conn, run_b, chosen),
        metrics=chosen,
        labels=(f"A: {run_a.name}", label_b),
        depths=(run_a.n_layers, run_b.n_layers),
        heat=heat,
        title=title,
        groups=[groups_held(conn, run_a.run_id), groups_held(conn, run_b.run_id)],
    )
