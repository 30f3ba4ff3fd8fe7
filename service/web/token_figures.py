"""Inline SVG figures over a text's tokens: a matrix with the tokens on both axes, and attention as
lines between two columns of the tokens (bertviz's head view).

Drawn on the server, as the other charts (``charts``), so that a page shows them without
JavaScript; each cell carries its value in ``data-v`` (app.js shows it with the cell's two tokens on
hover; a cell's own text would be two fifths of the page: 64 tokens draw 8,192 cells). The
head view needs no script either: hovering a token of the left column (or one of its lines) shows
its lines alone (the style sheet's ``svg.head-view`` rules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from headatlas.service.web.html import colour, e

# one colour per head of a layer (bertviz colours its heads so): tableau's 10, then two more
HEAD_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#ad494a",
)
LABEL_CHARS = 14  # a label's characters on an axis (the whole token in its tooltip)
CHAR_PX = 6.6  # the width of a character of the 11 px monospace labels


def head_colour(head: int) -> str:
    return HEAD_COLOURS[head % len(HEAD_COLOURS)]


def _label(token: str) -> str:
    shown = token.replace("\n", "⏎").replace("\t", "⇥")
    return shown if len(shown) <= LABEL_CHARS else shown[: LABEL_CHARS - 1] + "…"


def _label_px(tokens: Sequence[str]) -> int:
    return round(max((len(_label(t)) for t in tokens), default=1) * CHAR_PX) + 10


def _value(v: float) -> str:
    return f"{v:.4g}"


def matrix_svg(
    tokens: Sequence[str],
    matrix: np.ndarray,
    *,
    label: str,
    diverging: bool,
    high: Sequence[tuple[int, int]] = (),
    sentence_starts: Sequence[int] = (),
) -> str:
    """``matrix`` ``[query, key]`` as coloured cells, token ``i`` labelling row ``i`` (left) and
    column ``i`` (top). ``diverging``: blue–white–red about 0, scaled by the largest magnitude off
    the diagonal (a similarity matrix); else viridis on √value (attention: weights well under the
    largest still show). ``high``: pairs outlined (both (i, j) and (j, i))."""
    n = len(tokens)
    cell = 14 if n <= 40 else 12
    margin = _label_px(tokens)
    left, top = margin, margin
    size = n * cell
    values = np.asarray(matrix, dtype=np.float64)
    off = values[~np.eye(n, dtype=bool)] if n > 1 else values.ravel()
    largest = float(np.abs(off).max()) if off.size else 1.0
    largest = largest if math.isfinite(largest) and largest > 0 else 1.0
    parts = []
    for i in range(n):
        # a row a group (row i's cells in column order): the tooltip reads i and j from it
        cells = []
        for j in range(n):
            v = float(values[i, j])
            fill = (
                colour(v, -largest, largest, diverging=True)
                if diverging
                else colour(math.sqrt(max(v, 0.0)), 0.0, math.sqrt(largest))
            )
            cells.append(f'<rect x="{j * cell}" width="{cell}" height="{cell}" fill="{fill}" data-v="{_value(v)}"/>')
        parts.append(
            f'<g class="cells" data-i="{i}" transform="translate({left},{top + i * cell})">{"".join(cells)}</g>'
        )
    for i, j in high:
        for a, b in ((i, j), (j, i)):
            parts.append(
                f'<rect class="high" x="{left + b * cell}" y="{top + a * cell}" width="{cell}" height="{cell}"/>'
            )
    for s in sentence_starts:
        x = left + s * cell
        y = top + s * cell
        parts.append(f'<line class="sentence" x1="{x}" y1="{top}" x2="{x}" y2="{top + size}"/>')
        parts.append(f'<line class="sentence" x1="{left}" y1="{y}" x2="{left + size}" y2="{y}"/>')
    for i, token in enumerate(tokens):
        middle = i * cell + cell / 2
        tip = e(f"{i} «{token}»")
        parts.append(
            f'<text class="row" data-i="{i}" x="{left - 4}" y="{top + middle:.1f}" data-tip="{tip}">'
            f"{e(_label(token))}</text>"
        )
        parts.append(
            f'<text class="col" data-i="{i}" transform="translate({left + middle:.1f},{top - 4}) rotate(-90)" '
            f'data-tip="{tip}">{e(_label(token))}</text>'
        )
    width = height = margin + size + 2
    return (
        f'<svg class="token-matrix" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{e(label)}">{"".join(parts)}</svg>'
    )


def head_view_svg(
    tokens: Sequence[str], attention: Sequence[tuple[int, np.ndarray]], *, label: str, floor: float
) -> str:
    """Attention as lines from each query token (left column) to each key token (right column), a
    line's opacity its weight, one colour per head: ``attention`` holds (head, ``[query, key]``)
    for one head or every head of a layer. Weights under ``floor`` draw no line (they would not
    show, and a layer's lines stay a few thousand at most)."""
    n = len(tokens)
    row = 18
    label_px = _label_px(tokens)
    gap = 320
    left_x, right_x = label_px, label_px + gap
    width, height = 2 * label_px + gap + 4, n * row + 8

    def y(i: int) -> float:
        return 4 + i * row + row / 2

    groups = []
    for i in range(n):
        lines = []
        for head, matrix in attention:
            # a path a line, in one group a head: a layer's thousands of lines stay a few hundred KB
            paths = "".join(
                f'<path d="M{left_x + 2} {y(i):.1f}L{right_x - 2} {y(j):.1f}" stroke-opacity="{float(w):.3f}"/>'
                for j, w in enumerate(matrix[i])
                if w >= floor
            )
            if paths:
                lines.append(f'<g class="lines" data-head="{head}" stroke="{head_colour(head)}">{paths}</g>')
        groups.append(
            f'<g class="from" data-i="{i}"><text class="q" x="{left_x - 6}" y="{y(i):.1f}" '
            f'data-tip="{e(f"{i} «{tokens[i]}»: its attention, to the right")}">{e(_label(tokens[i]))}</text>'
            f"{''.join(lines)}</g>"
        )
    keys = "".join(
        f'<text class="k" data-i="{j}" x="{right_x + 6}" y="{y(j):.1f}">{e(_label(t))}</text>'
        for j, t in enumerate(tokens)
    )
    return (
        f'<svg class="head-view" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        f'role="img" aria-label="{e(label)}">{"".join(groups)}{keys}</svg>'
    )
