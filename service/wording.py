"""Counts in words: "1 batch", "2 batches" (a leaf: imports nothing of headatlas)."""

from __future__ import annotations

IRREGULAR = {"batch": "batches", "query": "queries", "is": "are"}


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for exactly one: ``counted(1, "batch")`` is "1 batch",
    ``counted(1200, "window")`` "1,200 windows"."""
    many = plural or IRREGULAR.get(noun) or f"{noun}s"
    return f"{n:,} {noun if n == 1 else many}"
