"""Figures of the corpus-averaged similarity matrices (SPEC §5c): one head's three matrices, or a
grid of a layer's heads.

Drawn from the rows of ``queries.csm`` (the ``csm_means`` view), with ``service.reports.plots``' figure
conventions: fixed sizes in inches, no pyplot, PNG or SVG by suffix. Cells are bins of ``bin``
positions on both axes (position 0 is [CLS]); the stored upper triangle is mirrored, since
C is symmetric. Layers and heads are 0-based.
"""

from __future__ import annotations

import matplotlib
import numpy as np
from matplotlib import colors

from headatlas.service.engine.results import CSM_KINDS
from headatlas.service.errors import ParameterError
from headatlas.service.layer_head import check_layer_head
from headatlas.service.params import CSM_BIN
from headatlas.service.reports import queries
from headatlas.service.reports.plots import _title, new_figure

HEAD_FIGSIZE = (16.0, 5.5)
PANELS = (
    ("all", "mean", "mean C_ij = z_i · z_j over all pairs of P"),
    ("attended", "pair_share", "attended high-similarity pairs: share of the cell's pairs"),
    ("noise", "pair_share", "noise pairs (similar, not attended): share of the cell's pairs"),
)
GRID_VALUE = {"all": "mean", "attended": "pair_share", "noise": "pair_share"}


def cell_grid(columns: list[str], rows: list[tuple], *, head: int, kind: str, value: str, n_bins: int) -> np.ndarray:
    """``[bin, bin]``: ``value`` of each stored cell of (head, kind), mirrored below the diagonal;
    NaN where the cell holds no pair."""
    grid = np.full((n_bins, n_bins), np.nan)
    hi, ki, bi, bj, vi = (columns.index(c) for c in ("head", "kind", "bin_i", "bin_j", value))
    for r in rows:
        if r[hi] == head and r[ki] == kind and r[vi] is not None:
            grid[r[bi], r[bj]] = grid[r[bj], r[bi]] = r[vi]
    return grid


def _symmetric_limit(grid: np.ndarray) -> float:
    """Colour limit of a mean-C map: the 99th percentile of |mean| (a few cells at [CLS]'s
    neighbours or at the window's end would wash the rest out)."""
    finite = np.abs(grid[np.isfinite(grid)])
    limit = float(np.percentile(finite, 99)) if finite.size else 0.0
    return limit if limit > 0 else 1.0


def _draw(ax, grid: np.ndarray, value: str, bin_size: int):
    extent = (0, grid.shape[1] * bin_size, grid.shape[0] * bin_size, 0)  # axes in token positions
    masked = np.ma.masked_invalid(grid)
    if value == "mean":
        limit = _symmetric_limit(grid)
        cmap_name = "RdBu_r"
        norm = colors.Normalize(-limit, limit)
    else:
        cmap_name = "magma_r"
        top = np.nanmax(grid) if np.isfinite(grid).any() else 1.0
        norm = colors.PowerNorm(0.5, vmin=0, vmax=max(float(top), 1e-9))
    cmap = matplotlib.colormaps[cmap_name].with_extremes(bad="#eeeeee")  # grey: no pair there
    return ax.imshow(masked, cmap=cmap, norm=norm, extent=extent, interpolation="nearest")


def figure_csm_head(columns, rows, *, head: int, layer: int, bin_size: int, n_bins: int, windows: int, title: str):
    """One head: mean C by position, and where its attended and its noise pairs of H fall."""
    fig = new_figure(*HEAD_FIGSIZE)
    axes = fig.subplots(1, 3)
    for ax, (kind, value, name) in zip(axes, PANELS):
        grid = cell_grid(columns, rows, head=head, kind=kind, value=value, n_bins=n_bins)
        image = _draw(ax, grid, value, bin_size)
        fig.colorbar(
            image,
            ax=ax,
            shrink=0.8,
            extend="both" if value == "mean" else "neither",
            label="mean C_ij" if value == "mean" else "pairs of this kind / pairs in the cell",
        )
        ax.set(title=name, xlabel="token position j", ylabel="token position i")
        ax.title.set_fontsize(9)
    fig.suptitle(
        f"{title}\nlayer {layer}, head {head} (0-based) · averaged over {windows:,} windows · "
        f"bins of {bin_size} position{'s' if bin_size > 1 else ''} · grey: no pair",
        fontsize=10,
    )
    return fig


def layer_figsize(n_heads: int) -> tuple[float, float]:
    cols = min(n_heads, 6)
    rows = -(-n_heads // cols)
    return 2.6 * cols + 0.5, 2.5 * rows + 1.0


def figure_csm_layer(
    columns, rows, *, layer: int, n_heads: int, kind: str, bin_size: int, n_bins: int, windows: int, title: str
):
    """Every head of a layer, one small matrix each, each on its own colour scale (heads differ by
    orders of magnitude)."""
    value = GRID_VALUE[kind]
    fig = new_figure(*layer_figsize(n_heads))
    cols = min(n_heads, 6)
    axes = np.atleast_1d(fig.subplots(-(-n_heads // cols), cols, squeeze=False)).ravel()
    for head, ax in enumerate(axes):
        if head >= n_heads:
            ax.set_visible(False)
            continue
        _draw(ax, cell_grid(columns, rows, head=head, kind=kind, value=value, n_bins=n_bins), value, bin_size)
        ax.set_title(f"head {head}", fontsize=8)
        ax.tick_params(labelsize=6)
    what = {k: name for k, _, name in PANELS}[kind]
    fig.suptitle(
        f"{title}\nlayer {layer} (0-based): {what} · {windows:,} windows · bins of {bin_size} · own colour "
        "scale per head",
        fontsize=9,
    )
    return fig


def run_csm(conn, run, *, layer: int, head: int | None = None, kind: str = "all"):
    """``plot csm`` for ``run`` (a store ``Run``): one head's three matrices, or with ``head``
    None the grid of ``layer``'s heads for ``kind``."""
    check_layer_head(layer, head, n_layers=run.n_layers, n_heads=run.n_heads, whose=f"run {run.run_id}")
    if kind not in CSM_KINDS:
        raise ParameterError(f"--kind {kind!r}: choose one of {', '.join(CSM_KINDS)}")
    bin_size = int(run.params.get("csm_bin", CSM_BIN))
    n_bins = -(-run.seq_len // bin_size) if bin_size else 0
    columns, rows = queries.csm(conn, run.run_id, layer=layer, head=head)
    windows = int(queries.run_summary(conn, run.run_id).get("windows") or 0)
    if head is not None:
        return figure_csm_head(
            columns, rows, head=head, layer=layer, bin_size=bin_size, n_bins=n_bins, windows=windows, title=_title(run)
        )
    return figure_csm_layer(
        columns,
        rows,
        layer=layer,
        n_heads=run.n_heads,
        kind=kind,
        bin_size=bin_size,
        n_bins=n_bins,
        windows=windows,
        title=_title(run),
    )
