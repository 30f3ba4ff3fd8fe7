"""Counts and durations in words (service/wording.py), by hand."""

from __future__ import annotations

from headatlas.service.wording import counted, seconds


def test_counts_take_their_noun_singular_for_exactly_one():
    assert [counted(n, "batch") for n in (0, 1, 2)] == ["0 batches", "1 batch", "2 batches"]
    assert counted(1200, "window") == "1,200 windows"


def test_durations_below_a_tenth_keep_two_significant_digits():
    # a small model's run of a few batches computes for hundredths: "0.0" would read as not recorded
    assert [seconds(s) for s in (None, 0.0, 0.0431, 0.0049, 0.1, 2.345, 123.4)] == [
        "0",
        "0",
        "0.043",
        "0.0049",
        "0.1",
        "2.3",
        "123.4",
    ]
