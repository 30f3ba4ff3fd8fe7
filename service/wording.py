"""Counts and durations in words: "1 batch", "2 batches", "0.043" s (a leaf: imports nothing of headatlas)."""

from __future__ import annotations

IRREGULAR = {"batch": "batches", "query": "queries", "is": "are"}


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for exactly one: ``counted(1, "batch")`` is "1 batch",
    ``counted(1200, "window")`` "1,200 windows"."""
    many = plural or IRREGULAR.get(noun) or f"{noun}s"
    return f"{n:,} {noun if n == 1 else many}"


def seconds(value: float | None) -> str:
    """A duration in seconds for a summary: tenths from 0.1 s, two significant digits below (a
    small model's run of a few batches computes for hundredths, which ``0.0`` would hide)."""
    if not value:
        return "0"
    return f"{value:.1f}" if value >= 0.1 else f"{value:.2g}"
