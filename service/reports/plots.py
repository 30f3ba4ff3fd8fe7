"""Figures of a stored run: distance distributions, sentence boundaries, head heatmaps, layers.

Every figure is drawn from the rows that ``service.reports.queries`` returns (the same numbers as
``headatlas query …``). Figures are built with ``matplotlib.figure.Figure`` and the Agg/SVG
canvases directly, never pyplot: no global state, no display needed. Import this module
lazily: matplotlib takes a while to import.

Figures have a fixed size in inches at ``DPI`` and are saved without tight cropping, so a PNG
is exactly ``figsize × DPI`` pixels (tests rely on it). Layers and heads are 0-based.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before anything can pick an interactive backend

import numpy as np
from matplotlib import colors
from matplotlib.figure import Figure
from sqlalchemy.engine import Connection

from headatlas.service.errors import ParameterError
from headatlas.service.metrics import chance_centre, chance_note
from headatlas.service.reports import distance_queries, layer_queries, queries
from headatlas.service.reports.columns import unknown_metric

DPI = 100
FORMATS = {".png": "png", ".svg": "svg"}
KINDS = ("distances", "boundaries", "heads", "layers")
RUN_FIGSIZE = {"distances": (13, 5.5), "boundaries": (12, 5), "heads": (11, 6.5), "layers": (14, 7)}


def new_figure(width_in: float, height_in: float) -> Figure:
    return Figure(figsize=(width_in, height_in), dpi=DPI, layout="constrained")


def output_format(out: str | Path) -> str:
    suffix = Path(out).suffix.lower()
    if suffix not in FORMATS:
        raise ParameterError(f"--out {out}: the file name must end in .png or .svg")
    return FORMATS[suffix]


def save(fig: Figure, out: str | Path, *, dpi: int = DPI) -> Path:
    """Write ``fig`` as PNG or SVG (by the file's suffix), creating the folder. A PNG is
    ``figsize × dpi`` pixels; an SVG ``figsize × 72`` points."""
    fmt = output_format(out)
    if not 20 <= dpi <= 600:
        raise ParameterError(f"--dpi {dpi}: choose between 20 and 600 (default {DPI})")
    path = Path(out)
    metadata = {"Software": None} if fmt == "png" else {"Date": None}  # reproducible bytes
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format=fmt, dpi=dpi, metadata=metadata)
    except OSError as exc:
        raise ParameterError(
            f"--out {out}: cannot write it ({exc.strerror or type(exc).__name__}); pass a file in a writable folder"
        ) from None
    return path


def pixel_size(fig: Figure, dpi: int = DPI) -> tuple[int, int]:
    width, height = fig.get_size_inches()
    return round(width * dpi), round(height * dpi)


def png_bytes(fig: Figure, *, dpi: int = DPI) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _col(columns: list[str], rows: list[tuple], name: str) -> np.ndarray:
    i = columns.index(name)
    return np.array([np.nan if r[i] is None else float(r[i]) for r in rows], dtype=float)


def _err(columns: list[str], rows: list[tuple], name: str) -> np.ndarray | None:
    """``[2, n]`` distances below/above the value to the 95% interval bounds (``name_lo``,
    ``name_hi``), for ``errorbar``'s yerr; None when the rows carry no interval."""
    if f"{name}_lo" not in columns:
        return None
    value, lo, hi = (_col(columns, rows, c) for c in (name, f"{name}_lo", f"{name}_hi"))
    return np.nan_to_num(np.vstack([value - lo, hi - value]), nan=0.0)


def _errorbar(ax, x, columns, rows, name, *, fmt="o-", **style):
    """A measure with its 95% interval as error bars (where the run has replicate groups)."""
    return ax.errorbar(
        x, _col(columns, rows, name), yerr=_err(columns, rows, name), fmt=fmt, capsize=2, elinewidth=0.9, **style
    )


INTERVAL_NOTE = "error bars: 95% jackknife intervals (t quantile, SPEC §5d)"


def interval_caption(*tables: tuple[list[str], list[tuple]], groups: list[int] | None = None) -> str:
    """INTERVAL_NOTE with the replicate scheme(s) the rows' intervals use (their ``interval_by``
    column) and ``groups``, the groups holding windows of each run drawn: "… over 12 replicate
    groups by document"."""
    from headatlas.service.reports.intervals import WINDOW_SCHEME, groups_words, scheme_words

    schemes = sorted({r[c.index("interval_by")] for c, rows in tables if "interval_by" in c for r in rows})
    if not schemes:
        return INTERVAL_NOTE
    note = f"{INTERVAL_NOTE} over {groups_words(groups)} {' / '.join(scheme_words(s) for s in schemes)}"
    return note + (" (stored before §5d: too narrow)" if WINDOW_SCHEME in schemes else "")


MAX_LAYER_TICKS = 16  # a layer axis labels every layer up to this many, then every 2nd, 5th, …


def layer_ticks(ax, layer: np.ndarray) -> None:
    """Integer layer ticks that stay apart: every layer up to MAX_LAYER_TICKS layers, else a step
    of 2, 5 or 10 (30 layers: 0, 5, … 25 and the last), never a run of digits."""
    values = [int(v) for v in layer if np.isfinite(v)]
    if not values:
        return
    lo, hi = min(values), max(values)
    if hi - lo + 1 <= MAX_LAYER_TICKS:
        ax.set_xticks(range(lo, hi + 1))
        return
    step = next(s for s in (2, 5, 10, 20, 50, 100) if (hi - lo) / s <= MAX_LAYER_TICKS / 2)
    ticks = list(range(lo - lo % step, hi + 1, step))
    if hi - ticks[-1] >= step / 2:  # the last layer too, where it does not crowd the one before
        ticks.append(hi)
    ax.set_xticks(ticks)


def suptitle(fig: Figure, title: str, *, fontsize: float = 12) -> None:
    """The figure's title, wrapped at " · " (then at spaces) to the figure's width, so that a long
    model name is never cut at both edges."""
    import textwrap

    width_pt = fig.get_size_inches()[0] * 72
    chars = max(20, int(width_pt / (fontsize * 0.58)))
    if len(title) <= chars:
        fig.suptitle(title, fontsize=fontsize)
        return
    lines, line = [], ""
    for part in title.split(" · "):
        joined = f"{line} · {part}" if line else part
        if len(joined) <= chars or not line:
            line = joined
        else:
            lines.append(line)
            line = part
    lines.append(line)
    wrapped = [w for one in lines for w in textwrap.wrap(one, chars)]
    fig.suptitle("\n".join(wrapped), fontsize=fontsize)


def _title(run) -> str:
    return f"run {run.run_id} ({run.name}) · {run.model_name} · {run.n_layers} layers × {run.n_heads} heads (0-based)"


# --- distances --------------------------------------------------------------------------------
def figure_distances(per_layer: dict[int, tuple[list[str], list[tuple]]], *, title: str) -> Figure:
    """Share of high-similarity pairs at each token distance, one line per layer, against the
    chance profile (share of all pairs at that distance); right: the ratio of the two."""
    fig = new_figure(*RUN_FIGSIZE["distances"])
    share_ax, lift_ax = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["viridis"]
    n = max(len(per_layer) - 1, 1)
    chance_drawn = False
    for layer, (columns, rows) in sorted(per_layer.items()):
        if not rows:
            continue
        d = _col(columns, rows, "distance")
        share, chance, lift = (_col(columns, rows, c) for c in ("share", "chance_share", "lift"))
        color = cmap(layer / n)
        label = f"layer {layer}" if len(per_layer) <= MAX_LEGEND_LAYERS else "_nolegend_"
        share_ax.plot(d, share, color=color, lw=1.4, label=label)
        lift_ax.plot(d, np.where(lift > 0, lift, np.nan), color=color, lw=1.4, label=label)
        if not chance_drawn:
            share_ax.plot(d, chance, color="black", ls="--", lw=1.6, label="chance (all pairs)")
            chance_drawn = True
    share_ax.set(
        xscale="log",
        xlabel="token distance j − i",
        ylabel="share of high-similarity pairs",
        title="distance distribution per layer",
    )
    lift_ax.axhline(1.0, color="black", ls="--", lw=1.2, label="chance")
    lift_ax.set(
        xscale="log",
        yscale="log",
        xlabel="token distance j − i",
        ylabel="share / chance share",
        title="over-representation against chance",
    )
    share_ax.legend(fontsize=8, ncols=2)
    for ax in (share_ax, lift_ax):
        ax.grid(alpha=0.3, which="both")
    layer_colour_bar(fig, (share_ax, lift_ax), len(per_layer))
    suptitle(fig, title)
    return fig


MAX_LEGEND_LAYERS = 12  # more layers than this: a colour bar by layer instead of a legend entry each


def layer_colour_bar(fig: Figure, axes, n_layers: int) -> None:
    """Where a figure has more than MAX_LEGEND_LAYERS layer lines: one colour bar of the layer
    (viridis, as the lines) beside ``axes``, in place of as many near-identical legend entries."""
    if n_layers <= MAX_LEGEND_LAYERS:
        return
    from matplotlib import cm, ticker

    mappable = cm.ScalarMappable(norm=colors.Normalize(0, n_layers - 1), cmap=matplotlib.colormaps["viridis"])
    bar = fig.colorbar(mappable, ax=list(axes), label="layer (line colour)", pad=0.01)
    bar.ax.yaxis.set_major_locator(ticker.MaxNLocator(nbins=8, integer=True))


def figure_distances_split(per_layer: dict[int, tuple[list[str], list[tuple]]], *, title: str) -> Figure:
    """The distance distribution of the attended (signal) pairs of H and of the not-attended
    (noise) pairs, one line per layer, each against the chance profile of all pairs (SPEC §5b)."""
    fig = new_figure(*RUN_FIGSIZE["distances"])
    axes = fig.subplots(1, 2, sharey=True)
    cmap = matplotlib.colormaps["viridis"]
    n = max(len(per_layer) - 1, 1)
    drawn = [(layer, rows_) for layer, rows_ in sorted(per_layer.items()) if rows_[1]]
    for ax, column, name in zip(
        axes, ("attended_share", "noise_share"), ("attended (signal) pairs", "noise pairs (similar, not attended)")
    ):
        if drawn:  # the chance profile is the run's: the same for every layer
            columns, rows = drawn[0][1]
            ax.plot(
                _col(columns, rows, "distance"),
                _col(columns, rows, "chance_share"),
                color="black",
                ls="--",
                lw=1.6,
                label="chance (all pairs)",
            )
        for layer, (columns, rows) in drawn:
            ax.plot(
                _col(columns, rows, "distance"),
                _col(columns, rows, column),
                color=cmap(layer / n),
                lw=1.4,
                label=f"layer {layer}" if len(per_layer) <= MAX_LEGEND_LAYERS else "_nolegend_",
            )
        ax.set(xscale="log", yscale="log", xlabel="token distance j − i", title=f"{name}: share at each distance")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("share of the pairs")
    axes[0].legend(fontsize=8, ncols=2)
    layer_colour_bar(fig, axes, len(per_layer))
    suptitle(fig, title)
    return fig


# --- boundaries -------------------------------------------------------------------------------
def figure_boundaries(columns: list[str], rows: list[tuple], *, title: str, groups: list[int] | None = None) -> Figure:
    """Within-sentence share of the high-similarity pairs per layer against two chances — all
    pairs, and pairs at the same distances (SPEC §5b) — the most within-sentence head of each
    layer, and attention to separators against uniform attention. Error bars: 95% intervals."""
    fig = new_figure(*RUN_FIGSIZE["boundaries"])
    share_ax, attn_ax = fig.subplots(1, 2)
    layer = _col(columns, rows, "layer")
    width = 0.27
    bars = (
        ("within_sentence", "#3b75af", "high-similarity pairs (layer)"),
        ("within_sentence_chance", "#bbbbbb", "chance: all pairs"),
        ("within_sentence_chance_dm", "#7a7a7a", "chance: same distances"),
    )
    for k, (name, color, label) in enumerate(bars):
        share_ax.bar(
            layer + (k - 1) * width,
            _col(columns, rows, name),
            width,
            color=color,
            label=label,
            yerr=_err(columns, rows, name),
            capsize=2,
            error_kw={"elinewidth": 0.9},
        )
    share_ax.plot(
        layer, _col(columns, rows, "max_head_within_sentence"), "D", color="#d1495b", label="best head of the layer"
    )
    for x, h, y in zip(layer, _col(columns, rows, "top_head"), _col(columns, rows, "max_head_within_sentence")):
        if not math.isnan(y):
            share_ax.annotate(
                f"h{int(h)}",
                (x, y),
                textcoords="offset points",
                xytext=(0, 5),
                ha="center",
                fontsize=8 if len(rows) <= MAX_LAYER_TICKS else 6,
            )
    share_ax.set(xlabel="layer", ylabel="share of pairs within one sentence", title="within-sentence share vs chance")
    share_ax.set_ylim(
        0, max(1.0, np.nanmax(_col(columns, rows, "max_head_within_sentence")) * 1.1) if len(rows) else 1.0
    )
    for name, color, label in (
        ("attn_to_punct_lift", "#d1495b", ". and ,"),
        ("attn_to_sep_lift", "#edae49", "[SEP]"),
        ("attn_to_cls_lift", "#00798c", "[CLS]"),
        ("attn_to_first_lift", "#00798c", "BOS (first token)"),  # a decoder's rows (query_support.for_attention)
    ):
        if name in columns:
            _errorbar(attn_ax, layer, columns, rows, name, color=color, label=label)
    attn_ax.axhline(1.0, color="black", ls="--", lw=1.2, label="uniform attention")
    attn_ax.set(
        xlabel="layer",
        ylabel="mean attention / uniform attention",
        yscale="log",
        title="attention to separators vs uniform",
    )
    for ax in (share_ax, attn_ax):
        layer_ticks(ax, layer)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    suptitle(fig, title)
    if "within_sentence_lo" in columns:
        fig.supxlabel(interval_caption((columns, rows), groups=groups), fontsize=8)
    return fig


MIN_DISTANCE_PAIRS = 40  # a layer's within-sentence share at a distance is drawn from this many pairs on
# … and its lift where chance expects this many of them within one sentence: the lift's relative
# standard error is about sqrt((1 - chance) / expected), 14% at 50
MIN_EXPECTED_PAIRS = 50


def figure_boundaries_by_distance(columns: list[str], rows: list[tuple], *, n_layers: int, title: str) -> Figure:
    """Within-sentence share of the high-similarity pairs at each token distance, one line per layer
    (its heads pooled), against its chance: the share of all pairs at that distance that share a
    sentence. Right: their ratio (1 = chance at that distance). A layer's share is drawn where it
    has MIN_DISTANCE_PAIRS high-similarity pairs at a distance, its lift where chance expects
    MIN_EXPECTED_PAIRS of them within one sentence (a ratio of two near-zero shares is noise);
    distances on a log scale labelled in plain numbers, the ratio on a linear one."""
    fig = new_figure(*RUN_FIGSIZE["boundaries"])
    share_ax, lift_ax = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["viridis"]
    n = max(n_layers - 1, 1)
    li, di = columns.index("layer"), columns.index("distance")
    enough = [r for r in rows if (r[columns.index("high_pairs")] or 0) >= MIN_DISTANCE_PAIRS]
    farthest = max((r[di] for r in enough), default=1)
    chance = {r[di]: r[columns.index("within_sentence_chance")] for r in rows if r[di] <= farthest}
    d_chance = np.array(sorted(chance), dtype=float)
    y_chance = np.array([np.nan if chance[d] is None else float(chance[d]) for d in sorted(chance)])
    share_ax.plot(d_chance, y_chance, color="black", ls="--", lw=1.6, label="chance: all pairs at that distance")
    lift_farthest = 1.0
    for layer in range(n_layers):
        mine = [r for r in enough if r[li] == layer]
        if not mine:
            continue
        d = _col(columns, mine, "distance")
        label = f"layer {layer}" if n_layers <= MAX_LEGEND_LAYERS else "_nolegend_"
        share_ax.plot(d, _col(columns, mine, "within_sentence"), color=cmap(layer / n), lw=1.4, label=label)
        lift = _col(columns, mine, "within_sentence_lift")
        expected = _col(columns, mine, "high_pairs") * _col(columns, mine, "within_sentence_chance")
        kept = np.where((lift > 0) & (expected >= MIN_EXPECTED_PAIRS), lift, np.nan)
        lift_ax.plot(d, kept, color=cmap(layer / n), lw=1.4, label=label)
        if np.isfinite(kept).any():
            lift_farthest = max(lift_farthest, float(d[np.isfinite(kept)].max()))
    share_ax.set(
        ylim=(0, 1.05),
        ylabel="share of high-similarity pairs within one sentence",
        title="within-sentence share by distance vs chance at that distance",
    )
    lift_ax.axhline(1.0, color="black", ls="--", lw=1.2, label="chance at that distance")
    lift_ax.set(ylabel="share / chance share at that distance", title="lift against chance at the same distance")
    for ax, last in ((share_ax, farthest), (lift_ax, lift_farthest)):
        _plain_log_distance(ax, last)
        ax.grid(alpha=0.3, which="major")
        ax.legend(fontsize=8, ncols=2)
    layer_colour_bar(fig, (share_ax, lift_ax), n_layers)
    suptitle(fig, title)
    fig.supxlabel(
        f"drawn where a layer has at least {MIN_DISTANCE_PAIRS} high-similarity pairs at a distance; its lift where "
        f"chance expects at least {MIN_EXPECTED_PAIRS} of them within one sentence",
        fontsize=8,
    )
    return fig


def _plain_log_distance(ax, farthest: float) -> None:
    """A token-distance x axis on a log scale with plain numbers (1, 2, 5, 10, 20 …) as labels."""
    from matplotlib import ticker

    ax.set_xscale("log")
    ax.set_xlim(0.9, max(2.0, farthest * 1.1))
    ax.xaxis.set_major_locator(ticker.FixedLocator([k * 10**e for e in range(4) for k in (1, 2, 5)]))
    ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xlabel("token distance j − i (log scale)")


# --- heads ------------------------------------------------------------------------------------
def figure_heads(
    columns: list[str], rows: list[tuple], metric: str, *, n_layers: int, n_heads: int, title: str
) -> Figure:
    """Layer × head heatmap of one column of ``query heads``; lifts are centred on 1 (chance)."""
    if metric not in queries.SORTABLE:
        raise unknown_metric("metric", metric, queries.SORTABLE)
    grid = np.full((n_layers, n_heads), np.nan)
    for l, h, v in zip(_col(columns, rows, "layer"), _col(columns, rows, "head"), _col(columns, rows, metric)):
        grid[int(l), int(h)] = v
    fig = new_figure(*RUN_FIGSIZE["heads"])
    ax = fig.subplots()
    finite = grid[np.isfinite(grid)]
    cmap_name, norm = chance_colours(metric, finite)
    cmap = matplotlib.colormaps[cmap_name].with_extremes(bad="#dddddd")  # grey: no value
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, norm=norm, aspect="auto")
    bar = fig.colorbar(image, ax=ax, label=metric + chance_note(metric))
    if isinstance(norm, colors.TwoSlopeNorm):  # the default ticks of a two-slope scale leave the short side bare
        assert norm.vmin is not None and norm.vmax is not None  # given when the norm was made
        bar.set_ticks(two_slope_ticks(norm.vmin, norm.vmax, norm.vcenter))
        bar.ax.yaxis.set_major_formatter("{x:g}")
    if n_heads <= 16 and n_layers <= 24:
        rgba = image.to_rgba(np.ma.masked_invalid(grid))
        for (l, h), v in np.ndenumerate(grid):
            if math.isfinite(v):
                dark = 0.299 * rgba[l, h, 0] + 0.587 * rgba[l, h, 1] + 0.114 * rgba[l, h, 2] < 0.5
                ax.text(h, l, f"{v:.3g}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set(xlabel="head", ylabel="layer", title=f"{metric} per head")
    suptitle(fig, title)
    return fig


def chance_colours(metric: str, values: np.ndarray) -> tuple[str, colors.Normalize | None]:
    """The colour map and norm of ``metric``'s ``values``: a column centred on chance (every lift,
    ``metrics.chance_centre``) on a diverging map whose white is chance — two slopes where the
    values lie on both sides of it, one side of the map where they lie on one; any other column
    on viridis."""
    centre = chance_centre(metric)
    if centre is None or not values.size:
        return "viridis", None
    lo, hi = float(values.min()), float(values.max())
    if lo < centre < hi:
        return "RdBu_r", colors.TwoSlopeNorm(vcenter=centre, vmin=lo, vmax=hi)
    # all on one side: chance at the end of the scale, so its colour still reads as chance (white)
    span = max(abs(hi - centre), abs(lo - centre)) or 1.0
    return "RdBu_r", colors.Normalize(vmin=centre - span, vmax=centre + span)


def two_slope_ticks(vmin: float, vmax: float, centre: float = 1.0) -> list[float]:
    """Round colour-bar ticks for a scale centred on ``centre``: a few on the short side, more on
    the long one (steps of 1, 2, 2.5 or 5 × a power of ten), always the centre."""
    from matplotlib import ticker

    def side(lo: float, hi: float, bins: int) -> np.ndarray:
        values = np.asarray(ticker.MaxNLocator(nbins=bins, steps=[1, 2, 2.5, 5, 10]).tick_values(lo, hi), dtype=float)
        return values[(values >= lo - 1e-12) & (values <= hi + 1e-12)]

    below, above = centre - vmin, vmax - centre
    ticks = np.r_[side(vmin, centre, 2 if below < above else 5), centre, side(centre, vmax, 5 if below < above else 2)]
    return sorted({round(float(t), 10) for t in ticks})


# --- layers -----------------------------------------------------------------------------------
LAYER_PANELS = (
    ("mean token distance of high-similarity pairs", (("mean_distance", "layer"), ("mean_distance_chance", "chance"))),
    ("share at short range (d ≤ short_range)", (("short_range_share", "layer"), ("short_range_chance", "chance"))),
    ("within-sentence share", (("within_sentence", "layer"),)),
    (
        "within-sentence lift (1 = chance)",
        (("within_sentence_lift", "vs all pairs"), ("within_sentence_lift_dm", "vs same distances")),
    ),
    ("repetition share", (("repetition", "same token"), ("repetition_words", "same word (no punctuation)"))),
    ("noise share (similar, not attended)", (("noise_share", "layer"),)),
    (
        "attention / uniform attention",
        (
            ("attn_to_cls_lift", "[CLS]"),
            ("attn_to_sep_lift", "[SEP]"),
            ("attn_to_first_lift", "BOS (first token)"),
            ("attn_to_punct_lift", ". ,"),
        ),
    ),
    (
        "attention entropy (nats) · anchor distinctness",
        (("attn_entropy", "entropy"), ("anchor_distinct_share", "distinct anchors")),
    ),
)


def figure_layers(columns: list[str], rows: list[tuple], *, title: str, groups: list[int] | None = None) -> Figure:
    """The layer progression: one small panel per measure of ``query layers``."""
    fig = new_figure(*RUN_FIGSIZE["layers"])
    axes = fig.subplots(2, 4, sharex=True).ravel()
    layer = _col(columns, rows, "layer")
    decoder = "attn_to_cls_lift" not in columns  # a decoder's rows: BOS, no [CLS]/[SEP] (query_support.for_attention)
    for ax, (name, series) in zip(axes, LAYER_PANELS):
        # an encoder's first token is [CLS]: its attn_to_first line would repeat the [CLS] line
        series = tuple(
            (c, label) for c, label in series if c in columns and not (c == "attn_to_first_lift" and not decoder)
        )
        for i, (column, label) in enumerate(series):
            style = "--" if label == "chance" else "o-"
            color = "black" if label == "chance" else f"C{i}"
            values = _col(columns, rows, column)
            if column == "anchor_distinct_share":  # a share beside nats: its own axis, labelled
                twin = ax.twinx()
                twin.plot(layer, values, "s:", color="C3", label=label)
                twin.set_ylim(0, 1.05)
                twin.set_ylabel("distinct anchors (share of windows)", fontsize=8, color="C3")
                twin.tick_params(axis="y", colors="C3", labelsize=8)
                ax.set_ylabel("entropy (nats)", fontsize=8, color="C0")
                twin.legend(fontsize=7, loc="lower right")
                continue
            if label == "chance":
                ax.plot(layer, values, style, color=color, label=label, ms=4)
            else:
                _errorbar(ax, layer, columns, rows, column, fmt=style, color=color, label=label, ms=4)
        if "lift" in name or "uniform" in name:
            ax.axhline(1.0, color="black", ls="--", lw=1)
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=7)
    for ax in axes[4:]:
        ax.set_xlabel("layer")
        layer_ticks(ax, layer)
    suptitle(fig, title)
    if "within_sentence_lo" in columns:
        fig.supxlabel(interval_caption((columns, rows), groups=groups), fontsize=8)
    return fig


# --- from the store ---------------------------------------------------------------------------
def run_figure(
    kind: str,
    conn: Connection,
    run,
    *,
    metric: str = "within_sentence_lift",
    split: str | None = None,
    by_distance: bool = False,
) -> Figure:
    """Draw one of ``KINDS`` for ``run`` (a store ``Run``) from the rows of ``service.reports.queries``.
    ``split="attended"`` (distances only): the signal and noise profiles instead of all of H;
    ``by_distance`` (boundaries only): the within-sentence share at each distance."""
    title = _title(run)

    def held() -> list[int]:
        from headatlas.service.reports.intervals import groups_held

        return [groups_held(conn, run.run_id)]

    if split is not None and (kind != "distances" or split != "attended"):
        raise ParameterError(f"--split {split!r}: the only split is 'attended' (signal vs noise pairs), for distances")
    if kind == "distances" and split:
        per_layer = {
            layer: distance_queries.distances(conn, run.run_id, layer=layer, split=True)
            for layer in range(run.n_layers)
        }
        if not any(r[c.index("attended_pairs")] is not None for c, rows in per_layer.values() for r in rows):
            raise ParameterError(
                f"--split attended: run {run.run_id} ({run.name}) was stored before attended pairs "
                "were counted; analyse the corpus again to draw signal and noise"
            )
        return figure_distances_split(per_layer, title=title)
    if kind == "distances":
        per_layer = {layer: distance_queries.distances(conn, run.run_id, layer=layer) for layer in range(run.n_layers)}
        return figure_distances(per_layer, title=title)
    if by_distance and kind != "boundaries":
        raise ParameterError(f"--by-distance: only for plot boundaries, not {kind}")
    if kind == "boundaries" and by_distance:
        return figure_boundaries_by_distance(
            *distance_queries.sentence_by_distance(conn, run.run_id), n_layers=run.n_layers, title=title
        )
    if kind == "boundaries":
        return figure_boundaries(*layer_queries.boundaries(conn, run.run_id, ci=True), title=title, groups=held())
    if kind == "heads":
        if metric not in queries.SORTABLE:
            raise unknown_metric("metric", metric, queries.SORTABLE)
        columns, rows = queries.heads(conn, run.run_id, anchors=0)
        return figure_heads(columns, rows, metric, n_layers=run.n_layers, n_heads=run.n_heads, title=title)
    if kind == "layers":
        return figure_layers(*layer_queries.layers(conn, run.run_id, ci=True), title=title, groups=held())
    raise ParameterError(f"plot {kind!r}: choose one of {', '.join(KINDS)}")
