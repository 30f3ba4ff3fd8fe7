"""Figures of one inspected text: a head's context similarity matrix next to its attention map,
or a layer × head grid of small matrices (``service.reports.inspection`` computes them).

Tokens label both axes of the single-head figure; its size grows with the number of tokens so
that a 128-token window keeps at least ``MIN_TOKEN_PX`` pixels per token (labels readable).
Sentence boundaries (SPEC §1) are drawn as lines between the last token of a sentence and the
first of the next. Layers and heads are 0-based.
"""

from __future__ import annotations

import numpy as np
from matplotlib import colors
from matplotlib.figure import Figure

from headatlas.service.errors import ParameterError
from headatlas.service.layer_head import check_head_has_layer
from headatlas.service.layer_head import check_layer_head as within
from headatlas.service.reports.inspection import Inspection
from headatlas.service.reports.plots import new_figure

MIN_TOKEN_PX = 9  # pixel pitch per token on the single-head figure (tests check it)
TOKEN_IN = 0.1  # inches per token: 10 px at 100 dpi
BOUNDARY = dict(color="#1b9e77", lw=1.0, ls="--")  # green: stands out on red, blue and white
MATRICES = ("csm", "attention")


def check_layer_head(insp: Inspection, layer: int | None, head: int | None) -> None:
    """A head is named by its layer, and both exist in the inspected model (service/layer_head.py)."""
    check_head_has_layer(layer, head)
    within(layer, head, n_layers=insp.n_layers, n_heads=insp.n_heads, whose="the model")


def csm_limit(csm: np.ndarray, in_pairs: np.ndarray) -> float:
    """Colour limit of a CSM: the 99th percentile of |C| over the pair universe, so that a few
    outliers (often [CLS]/[SEP] or a repeated token) do not wash the matrix out."""
    pair = np.outer(in_pairs, in_pairs)
    np.fill_diagonal(pair, False)
    values = np.abs(csm[..., pair]) if pair.any() else np.abs(csm)
    limit = float(np.percentile(values, 99)) if values.size else 0.0
    return limit if limit > 0 else 1.0


def token_labels(tokens: list[str]) -> list[str]:
    """Axis labels of ``tokens``: a byte-level vocabulary's strings as the text they stand for
    (``Ġthe`` → ``the``, ``Ġ`` → ``␣``, ``Ċ`` → ``\\n``; ``service.reports.tokens``), others as they are."""
    from headatlas.service.reports.tokens import is_byte_level_text, token_label

    byte_level = is_byte_level_text(tokens)
    return [token_label(t, byte_level) for t in tokens]


def head_figsize(n_tokens: int) -> tuple[float, float]:
    """Figure size in inches of the single-head figure for ``n_tokens`` tokens."""
    side = max(4.0, TOKEN_IN * n_tokens)  # the matrix itself
    return 2 * side + 4.2, side + 1.8  # labels, colourbars, titles


def figure_head(insp: Inspection, layer: int, head: int) -> Figure:
    """CSM (with the high-similarity set H marked) and attention map of one head, side by side."""
    check_layer_head(insp, layer, head)
    n = len(insp.tokens)
    labels = token_labels(insp.tokens)
    fig = new_figure(*head_figsize(n))
    csm_ax, attn_ax = fig.subplots(1, 2)
    csm = insp.csm[layer, head]
    limit = csm_limit(csm, insp.in_pairs)
    image = csm_ax.imshow(csm, cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
    fig.colorbar(image, ax=csm_ax, shrink=0.6, extend="both", label="C_ij = z_i · z_j")
    rows, cols = np.nonzero(insp.high[layer, head])
    cell_pt = max(4.0, TOKEN_IN * n) * 72 / max(n, 1)  # one cell, in points
    marker = (0.75 * cell_pt) ** 2
    csm_ax.scatter(cols, rows, s=marker, marker="s", facecolors="none", edgecolors="black", linewidths=0.6)
    attention = insp.attention[layer, head]
    image = attn_ax.imshow(
        attention,
        cmap="Blues",
        norm=colors.PowerNorm(0.5, vmin=0, vmax=max(attention.max(), 1e-9)),
        interpolation="nearest",
    )
    fig.colorbar(image, ax=attn_ax, shrink=0.6, label="attention weight (square-root scale)")
    fontsize = 6 if n > 64 else 8
    special = insp.sentence < 0
    for ax in (csm_ax, attn_ax):
        # parse_math off: a "$" token must not start mathtext
        ax.set_xticks(range(n), labels, rotation=90, fontsize=fontsize, parse_math=False)
        ax.set_yticks(range(n), labels, fontsize=fontsize, parse_math=False)
        for labels in (ax.get_xticklabels(), ax.get_yticklabels()):
            for text, is_special in zip(labels, special):
                if is_special:
                    text.set_color("#888888")
        ax.tick_params(length=1.5, pad=1)
        _boundaries(ax, insp.sentence_starts())
    select = insp.params.select
    # two short lines: one long line overran a short text's narrow panel and was cut at the edge
    csm_ax.set_title(f"context similarity C = z zᵀ (C_ii = 0)\nsquares: high-similarity pairs ({select})", fontsize=10)
    attn_ax.set_title("attention A\nrows = queries, columns = keys", fontsize=10)
    csm_ax.set_xlabel("token j")
    csm_ax.set_ylabel("token i")
    attn_ax.set_xlabel("key")
    attn_ax.set_ylabel("query")
    fig.suptitle(_title(insp, f"layer {layer}, head {head} (0-based)"))
    return fig


def figure_grid(insp: Inspection, *, layer: int | None = None, matrix: str = "csm") -> Figure:
    """One small matrix per head: rows are layers (only ``layer`` when given), columns heads.
    Each cell has its own colour scale (heads differ by orders of magnitude)."""
    if matrix not in MATRICES:
        raise ParameterError(f"--matrix {matrix!r}: choose one of {', '.join(MATRICES)}")
    check_layer_head(insp, layer, None)
    layers = [layer] if layer is not None else list(range(insp.n_layers))
    cell = 1.35
    fig = new_figure(cell * insp.n_heads + 1.0, cell * len(layers) + 1.0)
    axes = np.atleast_2d(fig.subplots(len(layers), insp.n_heads, squeeze=False))
    starts = insp.sentence_starts()
    for r, l in enumerate(layers):
        for h in range(insp.n_heads):
            ax = axes[r, h]
            if matrix == "csm":
                limit = csm_limit(insp.csm[l, h], insp.in_pairs)
                ax.imshow(insp.csm[l, h], cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
            else:
                a = insp.attention[l, h]
                ax.imshow(
                    a,
                    cmap="Blues",
                    norm=colors.PowerNorm(0.5, vmin=0, vmax=max(a.max(), 1e-9)),
                    interpolation="nearest",
                )
            _boundaries(ax, starts, lw=0.8)
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(f"head {h}", fontsize=8)
            if h == 0:
                ax.set_ylabel(f"layer {l}", fontsize=8)
    what = "context similarity C = z zᵀ" if matrix == "csm" else "attention"
    fig.suptitle(
        _title(insp, f"{what}, every head (own colour scale per cell; dashed: sentence boundaries)"), fontsize=9
    )
    return fig


def _boundaries(ax, starts: list[int], lw: float | None = None) -> None:
    style = dict(BOUNDARY, lw=lw or BOUNDARY["lw"])
    for p in starts:
        ax.axhline(p - 0.5, **style)
        ax.axvline(p - 0.5, **style)


def _title(insp: Inspection, what: str) -> str:
    cut = " · first window of a longer text" if insp.truncated else ""
    return f"{insp.model_name} · {what} · {len(insp.tokens)} tokens{cut}"
