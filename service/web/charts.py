"""Inline SVG figures: a line chart with 95% intervals and a bar chart against chance.

Drawn on the server, so a page shows them without JavaScript; every point carries its value and
interval in ``data-tip`` (app.js shows it on hover or focus) and in an SVG ``<title>`` (the
browser's own tooltip where scripts are off).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from headatlas.service.web.html import e, interval, num

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass(frozen=True)
class Point:
    x: float
    y: float | None
    lo: float | None = None
    hi: float | None = None
    tip: str = ""  # the hover text


@dataclass(frozen=True)
class Series:
    name: str
    points: Sequence[Point]


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round values spanning [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)) or high <= low:
        return [low]
    raw = (high - low) / count
    step = 10 ** math.floor(math.log10(raw))
    step *= next(m for m in (1, 2, 2.5, 5, 10) if raw <= m * step)
    first = math.ceil(low / step) * step
    return [round(first + k * step, 12) for k in range(int((high - first) / step + 1e-9) + 1)]


class _Frame:
    """Data to pixels: the plot area inside margins, axes, grid lines and their labels."""

    def __init__(self, width: int, height: int, xs: Sequence[float], ys: Sequence[float], *, x_pad: float = 0.0):
        self.width, self.height = width, height
        self.left, self.right, self.top, self.bottom = 56, 12, 14, 40
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        if self.x1 <= self.x0:
            self.x0, self.x1 = self.x0 - 0.5, self.x1 + 0.5
        pad = (self.x1 - self.x0) * x_pad
        self.x0, self.x1 = self.x0 - pad, self.x1 + pad
        y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        pad = (y1 - y0) * 0.06 or abs(y1) * 0.1 or 1.0
        self.y0, self.y1 = y0 - pad, y1 + pad

    def x(self, v: float) -> float:
        span = self.width - self.left - self.right
        return self.left + (v - self.x0) / (self.x1 - self.x0) * span

    def y(self, v: float) -> float:
        span = self.height - self.top - self.bottom
        return self.top + (1 - (v - self.y0) / (self.y1 - self.y0)) * span

    def axes(self, x_label: str, y_label: str, x_ticks: Sequence[float] | None = None) -> str:
        parts = []
        for v in ticks(self.y0, self.y1):
            y = self.y(v)
            parts.append(
                f'<line class="grid" x1="{self.left}" x2="{self.width - self.right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            )
            parts.append(f'<text class="tick" x="{self.left - 6}" y="{y + 4:.1f}" text-anchor="end">{num(v)}</text>')
        for v in x_ticks if x_ticks is not None else ticks(self.x0, self.x1, 8):
            x = self.x(v)
            parts.append(
                f'<text class="tick" x="{x:.1f}" y="{self.height - self.bottom + 16}" text-anchor="middle">{num(v)}</text>'
            )
        base = self.height - self.bottom
        parts.append(f'<line class="axis" x1="{self.left}" x2="{self.width - self.right}" y1="{base}" y2="{base}"/>')
        parts.append(f'<line class="axis" x1="{self.left}" x2="{self.left}" y1="{self.top}" y2="{base}"/>')
        parts.append(
            f'<text class="label" x="{(self.left + self.width - self.right) / 2:.0f}" y="{self.height - 6}" '
            f'text-anchor="middle">{e(x_label)}</text>'
        )
        parts.append(
            f'<text class="label" transform="translate(14 {(self.top + base) / 2:.0f}) rotate(-90)" '
            f'text-anchor="middle">{e(y_label)}</text>'
        )
        return "".join(parts)

    def reference(self, value: float, label: str) -> str:
        if not self.y0 <= value <= self.y1:
            return ""
        y = self.y(value)
        return (
            f'<line class="ref" x1="{self.left}" x2="{self.width - self.right}" y1="{y:.1f}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{self.width - self.right - 4}" y="{y - 4:.1f}" text-anchor="end">{e(label)}</text>'
        )


def _svg(width: int, height: int, label: str, inner: str) -> str:
    return (
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{e(label)}">{inner}</svg>'
    )


def line_chart(
    series: Sequence[Series],
    *,
    x_label: str,
    y_label: str,
    width: int = 760,
    height: int = 280,
    x_ticks: Sequence[float] | None = None,
    reference: tuple[float, str] | None = None,
    x_range: tuple[float, float] | None = None,
) -> str:
    """Each series a line through its points, with its 95% interval as a bar at every point;
    ``x_range``: the x axis's span (default the points', padded)."""
    xs = list(x_range) if x_range else [p.x for s in series for p in s.points]
    ys = [v for s in series for p in s.points for v in (p.y, p.lo, p.hi) if v is not None and math.isfinite(v)]
    if reference is not None:
        ys.append(reference[0])
    frame = _Frame(width, height, xs, ys, x_pad=0.0 if x_range else 0.04)
    parts = [frame.axes(x_label, y_label, x_ticks)]
    if reference is not None:
        parts.append(frame.reference(*reference))
    for k, s in enumerate(series):
        colour = PALETTE[k % len(PALETTE)]
        drawn = [p for p in s.points if p.y is not None and math.isfinite(p.y)]
        path = " ".join(f"{'M' if i == 0 else 'L'}{frame.x(p.x):.1f},{frame.y(p.y):.1f}" for i, p in enumerate(drawn))  # type: ignore[arg-type]
        parts.append(f'<path class="line" d="{path}" stroke="{colour}"/>')
        for p in drawn:
            x, y = frame.x(p.x), frame.y(p.y)  # type: ignore[arg-type]
            if p.lo is not None and p.hi is not None:
                parts.append(
                    f'<line class="err" x1="{x:.1f}" x2="{x:.1f}" y1="{frame.y(p.lo):.1f}" y2="{frame.y(p.hi):.1f}" '
                    f'stroke="{colour}"/>'
                )
            tip = p.tip or f"{s.name}: {num(p.y)} {interval(p.lo, p.hi)}"
            parts.append(
                f'<circle class="pt" cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="{colour}" tabindex="0" '
                f'data-tip="{e(tip)}"><title>{e(tip)}</title></circle>'
            )
    if len(series) > 1:
        parts.append(_legend(series, frame))
    return _svg(width, height, y_label, "".join(parts))


def _legend(series: Sequence[Series], frame: _Frame) -> str:
    items, x = [], frame.left + 8
    for k, s in enumerate(series):
        colour = PALETTE[k % len(PALETTE)]
        items.append(
            f'<rect x="{x}" y="{frame.top + 2}" width="12" height="4" fill="{colour}"/>'
            f'<text class="tick" x="{x + 16}" y="{frame.top + 8}">{e(s.name)}</text>'
        )
        x += 28 + 7 * len(s.name)
    return "".join(items)


def bar_chart(
    xs: Sequence[int],
    bars: Sequence[float | None],
    marks: Sequence[float | None],
    tips: Sequence[str],
    *,
    x_label: str,
    y_label: str,
    bar_name: str,
    mark_name: str,
    width: int = 760,
    height: int = 260,
) -> str:
    """Bars (e.g. a head's share of pairs at each distance) and a step line of marks (their
    chance) over integer ``xs``; hovering a column shows ``tips``."""
    values = [v for v in (*bars, *marks) if v is not None and math.isfinite(v)] + [0.0]
    frame = _Frame(width, height, [min(xs) - 0.5, max(xs) + 0.5] if xs else [], values)
    frame.y0 = 0.0
    step = (frame.x(1) - frame.x(0)) if xs else 1.0
    parts = [frame.axes(x_label, y_label)]
    base = frame.y(0)
    steps: list[str] = []
    for x, bar, mark, tip in zip(xs, bars, marks, tips):
        left = frame.x(x - 0.5)
        if bar is not None and math.isfinite(bar):
            top = frame.y(bar)
            parts.append(
                f'<rect class="bar" x="{left + step * 0.1:.1f}" y="{top:.1f}" width="{step * 0.8:.1f}" '
                f'height="{max(0.0, base - top):.1f}"/>'
            )
        if mark is not None and math.isfinite(mark):
            steps.append(
                f"{'M' if not steps else 'L'}{left:.1f},{frame.y(mark):.1f} L{left + step:.1f},{frame.y(mark):.1f}"
            )
        parts.append(
            f'<rect class="hit" x="{left:.1f}" y="{frame.top}" width="{step:.1f}" height="{base - frame.top:.1f}" '
            f'data-tip="{e(tip)}"><title>{e(tip)}</title></rect>'
        )
    parts.append(f'<path class="mark" d="{" ".join(steps)}"/>')
    parts.append(
        f'<rect class="bar" x="{frame.left + 8}" y="{frame.top + 2}" width="12" height="8"/>'
        f'<text class="tick" x="{frame.left + 24}" y="{frame.top + 10}">{e(bar_name)}</text>'
        f'<line class="mark" x1="{frame.left + 120}" x2="{frame.left + 136}" y1="{frame.top + 6}" y2="{frame.top + 6}"/>'
        f'<text class="tick" x="{frame.left + 140}" y="{frame.top + 10}">{e(mark_name)}</text>'
    )
    return _svg(width, height, y_label, "".join(parts))
