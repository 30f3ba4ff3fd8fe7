"""Sparklines: a series drawn as a line of bars, from 0 or over the values' own range."""

from __future__ import annotations

import math

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], *, top: float | None = None) -> str:
    """Bars from 0 to ``top`` (default the largest value): for shares and counts, whose 0 means
    something (a distance profile)."""
    clean = [0.0 if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values]
    top = max(clean, default=0.0) if top is None else top
    if top <= 0:
        return SPARK[0] * len(clean)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))] for v in clean)


def range_sparkline(values: list[float | None]) -> str:
    """Bars from the values' own minimum to their maximum: for a series that moves far from 0 (a
    lift of 1.035 → 1.015 would draw two full bars from 0). A missing value is a space; a series
    that does not move is drawn at mid height."""
    clean = [None if v is None or math.isnan(float(v)) else float(v) for v in values]
    present = [v for v in clean if v is not None]
    low, high = min(present, default=0.0), max(present, default=0.0)
    if high <= low:
        return "".join(" " if v is None else SPARK[len(SPARK) // 2 - 1] for v in clean)
    top = len(SPARK) - 1
    return "".join(" " if v is None else SPARK[int((v - low) / (high - low) * top + 0.5)] for v in clean)


def trend_line(metric: str, values: list[float | None]) -> str:
    """``query trend``'s line under its table: the sparkline and the range it spans."""
    present = [v for v in values if v is not None and not math.isnan(float(v))]
    return f"{metric} {range_sparkline(values)}  ({min(present, default=0):.4g} … {max(present, default=0):.4g})"
