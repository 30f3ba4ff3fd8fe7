"""Figures of the head atlas and of two runs compared (SPEC §7; ``service.reports.compare``).

Drawn from the rows of ``service.reports.roles`` and ``service.reports.compare`` (the numbers of ``headatlas
query roles`` and ``headatlas compare``), with ``service.reports.plots``' figure conventions: fixed
sizes in inches, no pyplot, PNG or SVG by suffix. Layers and heads are 0-based.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from matplotlib import colors, ticker
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
# a role as a cell names it: a word (letter codes read as a cipher on a grid of 144 heads), short
# enough for a cell of 0.62 in at 6 points
ROLE_WORDS = {
    "previous-token": "prev-token",
    "next-token": "next-token",
    "induction": "induction",
    "duplicate-token": "duplicate",
    "repetition": "repetition",
    "sentence-bound": "sentence",
    "punctuation": "punct",
    "local": "local",
    "[CLS] sink": "CLS sink",
    "first-token sink": "first sink",
    "[SEP] sink": "SEP sink",
    "broad": "broad",
    role_rules.NONE: "",
}
ATLAS_ROLES = (*role_rules.ROLE_ORDER, role_rules.NONE)
FADE = 0.6  # the share of white laid over an uncertain cell: its colour still shows, quieter
COLOURS = ("role", "evidence")  # besides a column of ``query heads``: what ``--colour`` may name
ROLE_FADED = "faded, italic: unsure (not held on\nboth halves, or its 95% interval\nreaches its threshold)"


@dataclass(frozen=True)
class Shade:
    """What the cells are coloured by where not the primary role: ``label`` (the colour bar's),
    ``values`` ``[layer, head]`` (NaN: no value), ``uncertain`` ``[layer, head]`` (drawn faded),
    ``faded`` (the legend's words for a faded cell), ``diverging`` (about 0: an effect, of either
    sign), ``log`` (a ratio of 1 and more: the evidence)."""

    label: str
    values: np.ndarray
    uncertain: np.ndarray
    faded: str
    diverging: bool = False
    log: bool = False


def atlas_size(n_layers: int, n_heads: int) -> tuple[float, float]:
    """Inches (whole quarters, so pixel and point sizes are exact): cells stay about 0.6 × 0.45 in,
    with room for the legend on the right."""
    return _quarter(max(8.0, 3.6 + 0.62 * n_heads)), _quarter(max(4.5, 1.6 + 0.45 * n_layers))


def _quarter(inches: float) -> float:
    return math.ceil(inches * 4) / 4


def role_uncertain(columns: list[str], row: tuple) -> bool:
    """A role whose evidence is unsure: not held on both halves (where ``row`` has stability), or
    its 95% interval reaching its threshold (a lower bound: ``value_lo`` at or under it)."""
    at = {c: i for i, c in enumerate(columns)}
    if "stable" in at and row[at["stable"]] is False:
        return True
    lo, threshold = (row[at[c]] if c in at else None for c in ("value_lo", "threshold"))
    return isinstance(lo, (int, float)) and isinstance(threshold, (int, float)) and lo <= threshold


def evidence_shade(columns: list[str], rows: list[tuple], n_layers: int, n_heads: int) -> Shade | None:
    """Each head's primary role's value over its threshold (1: just earned; a lift of 30 on a
    threshold of 10: 3), one scale for roles measured in different units; None where no row
    carries a value and a threshold (hand-built rows)."""
    at = {c: i for i, c in enumerate(columns)}
    if "value" not in at or "threshold" not in at:
        return None
    values = np.full((n_layers, n_heads), np.nan)
    uncertain = np.zeros((n_layers, n_heads), dtype=bool)
    for r in rows:
        value, threshold = r[at["value"]], r[at["threshold"]]
        if not r[at["primary"]] or r[at["role"]] == role_rules.NONE:
            continue
        if isinstance(value, (int, float)) and isinstance(threshold, (int, float)) and threshold > 0 and value > 0:
            values[r[at["layer"]], r[at["head"]]] = max(1.0, value / threshold)
        uncertain[r[at["layer"]], r[at["head"]]] = role_uncertain(columns, r)
    if np.isnan(values).all():
        return None
    return Shade("primary role's value / its threshold", values, uncertain, ROLE_FADED, log=True)


def figure_atlas(
    columns: list[str],
    rows: list[tuple],
    *,
    n_layers: int,
    n_heads: int,
    title: str,
    offered: tuple[str, ...] | None = None,
    shade: Shade | None = None,
) -> tuple:
    """Layer × head grid; each cell names its head's primary role in a word (and the count of any
    other roles it holds). ``shade`` colours the cells (an effect, the evidence: ``run_atlas``
    chooses); without it, each cell has its primary role's colour (legend: role and colour). An
    uncertain cell is drawn faded rather than hidden under a mark: under ``shade``, its
    ``uncertain``; by role, a primary role that does not hold on both halves or whose interval
    reaches its threshold (``role_uncertain``). ``offered``: the run's roles
    (``role_rules.offered_roles``), the legend's entries; default every role. Returns (figure, role
    index grid)."""
    grid = role_views.primary_grid(columns, rows, n_layers, n_heads)
    index = np.full((n_layers, n_heads), np.nan)
    for (l, h), _ in np.ndenumerate(index):
        if grid[l][h] is not None:
            index[l, h] = ATLAS_ROLES.index(grid[l][h])
    held: dict[tuple[int, int], list[str]] = {}
    unsure: set[tuple[int, int, str]] = set()
    li, hi, ri = (columns.index(c) for c in ("layer", "head", "role"))
    for r in rows:
        if r[ri] != role_rules.NONE:
            held.setdefault((r[li], r[hi]), []).append(r[ri])
            if role_uncertain(columns, r):
                unsure.add((r[li], r[hi], r[ri]))
    fig = new_figure(*atlas_size(n_layers, n_heads))
    ax = fig.subplots()
    if shade is None:
        cmap = colors.ListedColormap([ROLE_COLOURS[r] for r in ATLAS_ROLES]).with_extremes(bad="#ffffff")
        norm: colors.Normalize = colors.BoundaryNorm(np.arange(len(ATLAS_ROLES) + 1) - 0.5, len(ATLAS_ROLES))
        image = ax.imshow(np.ma.masked_invalid(index), cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        drawn = index
        faded = np.array([[(l, h, grid[l][h]) in unsure for h in range(n_heads)] for l in range(n_layers)])
    else:
        image = ax.imshow(
            np.ma.masked_invalid(shade.values),
            cmap=_shade_map(shade),
            norm=_shade_norm(shade),
            aspect="auto",
            interpolation="nearest",
        )
        drawn = shade.values
        # a thin bar: in a tall atlas (30 layers) matplotlib's default, sized by the height, took a fifth of the grid
        bar = fig.colorbar(image, ax=ax, label=shade.label, location="right", pad=0.02, fraction=0.04, aspect=40)
        if shade.log:  # 1×, 2×, 5×, 10× …: a run's ratios often stay under 10, where a decade's ticks name only 1×
            top = float(np.nanmax(shade.values))
            marks = [m * 10**k for k in range(4) for m in (1, 2, 5) if m * 10**k <= max(2.0, top)]
            bar.set_ticks(marks, labels=[f"{m:g}×" for m in marks])
            bar.ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        faded = shade.uncertain
    for (l, h), flag in np.ndenumerate(faded):
        if flag:  # white laid over the cell: its colour quieter, still there
            ax.add_patch(Rectangle((h - 0.5, l - 0.5), 1, 1, facecolor="white", alpha=FADE, lw=0))
    for (l, h), names in held.items():
        primary = grid[l][h]
        if primary is None or primary == role_rules.NONE:
            continue
        word = ROLE_WORDS[primary] + (f"\n+{len(names) - 1}" if len(names) > 1 else "")
        rgba = np.array(image.to_rgba(drawn[l, h]))
        if faded[l, h]:
            rgba[:3] = rgba[:3] * (1 - FADE) + FADE
        dark = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] < 0.55
        ax.text(
            h,
            l,
            word,
            ha="center",
            va="center",
            fontsize=6,
            linespacing=1.0,
            color="white" if dark else "black",
            fontstyle="italic" if (l, h, primary) in unsure else "normal",
        )
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xticks(np.arange(n_heads + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(n_layers + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=1.5)
    ax.tick_params(which="minor", length=0)
    # the title and the legend name what the colour is: the primary role, or what is shaded (its
    # scale in the colour bar; the words still name each head's primary role)
    coloured = "primary role" if shade is None else shade.label
    ax.set(xlabel="head", ylabel="layer", title=f"{coloured} per head")
    listed = role_rules.ROLE_ORDER if offered is None else offered
    counts = role_views.role_counts(columns, rows, listed)
    stable = role_views.stable_counts(columns, rows)
    handles = [
        Patch(
            facecolor=ROLE_COLOURS[r] if shade is None else "none",
            edgecolor="#999999",
            label=f"{r} ({counts[r]}" + (f", {stable[r]} stable" if stable is not None and r in stable else "") + ")",
        )
        for r in ATLAS_ROLES
        if r in counts
    ]
    said = ROLE_FADED if shade is None else shade.faded
    if said and (faded.any() or stable is not None):
        grey = (0.6 * (1 - FADE) + FADE,) * 3
        handles.append(Patch(facecolor=grey, edgecolor="#999999", label=said))
    fig.legend(
        handles=handles,
        loc="outside right center",
        fontsize=8,
        title="role (heads holding it)" if shade is None else f"words: role (heads holding it)\ncolour: {shade.label}",
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


def _shade_map(shade: Shade) -> colors.Colormap:
    from matplotlib import colormaps

    # no value (no role, no effect measured): a pale grey, apart from every colour of the scale
    return colormaps["RdBu_r" if shade.diverging else "YlGnBu"].with_extremes(bad="#f2f2f2")


def _shade_norm(shade: Shade) -> colors.Normalize:
    finite = shade.values[np.isfinite(shade.values)]
    if shade.diverging:  # about 0: a head whose removal helps is blue, one whose removal costs red
        top = float(np.abs(finite).max()) or 1.0
        return colors.Normalize(-top, top)
    if shade.log:
        return colors.LogNorm(1.0, max(2.0, float(finite.max())))
    return colors.Normalize(float(finite.min()), float(finite.max()))


def effect_shade(conn, run, column: str) -> Shade | None:
    """``column`` (an effect: O with the head removed − O intact) per head, a cell faded where its
    95% interval includes 0; None where the run holds no value of it."""
    from headatlas.service.reports import queries

    columns, rows = queries.heads(conn, run.run_id, ci=True)
    if column not in columns:
        return None
    at = {c: i for i, c in enumerate(columns)}
    values = np.full((run.n_layers, run.n_heads), np.nan)
    uncertain = np.zeros((run.n_layers, run.n_heads), dtype=bool)
    diverging = column.startswith("effect_")  # O(removed) − O(intact): of either sign, unsure where 0 is in reach
    lo, hi = at.get(f"{column}_lo"), at.get(f"{column}_hi")
    for r in rows:
        value = r[at[column]]
        if value is None:
            continue
        values[r[at["layer"]], r[at["head"]]] = value
        if diverging and lo is not None and hi is not None and r[lo] is not None and r[hi] is not None:
            uncertain[r[at["layer"]], r[at["head"]]] = r[lo] <= 0 <= r[hi]
    if np.isnan(values).all():
        return None
    return Shade(
        column,
        values,
        uncertain,
        "faded: unsure (its 95%\ninterval includes 0)" if diverging else "",
        diverging=diverging,
    )


# the effects a run's atlas is coloured by first, where measured: what removing the head costs
DEFAULT_EFFECTS = ("effect_mean", "effect_zero")


def run_atlas(conn, run, *, colour: str | None = None) -> tuple:
    """The atlas of ``run`` (a store ``Run``) from ``roles.roles`` with stability. ``colour``: the
    cells' colour; by default the strongest evidence the run holds: its causal effect
    (``effect_mean``, else ``effect_zero``: what removing the head costs, SPEC §9), else its
    primary role's value over its threshold (``evidence``); ``role``: the primary role's own
    colour; or any column of ``query heads``."""
    from headatlas.service.reports.columns import HEAD_COLUMNS, unknown_metric

    columns, rows = roles.roles(conn, run.run_id, stability=True)
    offered = role_rules.offered_roles(attention_kind.causal_run(conn, run.run_id))
    shapes = (run.n_layers, run.n_heads)
    shade: Shade | None
    if colour is None:
        shade = next((s for c in DEFAULT_EFFECTS if (s := effect_shade(conn, run, c)) is not None), None)
        if shade is None:
            shade = evidence_shade(columns, rows, *shapes)
    elif colour == "role":
        shade = None
    elif colour == "evidence":
        shade = evidence_shade(columns, rows, *shapes)
        if shade is None:
            raise ParameterError(f"--colour evidence: run {run.run_id} has no head with a role; try --colour role")
    else:
        choices = HEAD_COLUMNS[2:-1]
        if colour not in choices:
            raise unknown_metric("colour", colour, (*COLOURS, *choices))
        shade = effect_shade(conn, run, colour)
        if shade is None:
            how = "effects RUN --streaming" if colour == "effect_streaming" else "analyze --effects"
            raise ParameterError(f"--colour {colour}: run {run.run_id} has no value of it (effects: {how})")
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
