"""The half-precision agreement checks shared by the CPU and the CUDA tests (tolerances in
tests/test_precision.py's docstring)."""

from __future__ import annotations

import numpy as np


def assert_half_agrees(full, half) -> None:
    """``full``, ``half``: BatchResults of the same batch in float32 and under bf16 autocast."""
    np.testing.assert_array_equal(half.heads["high_pairs"], full.heads["high_pairs"])
    share = lambda r, k: r.heads[k].sum(1) / r.heads["high_pairs"].sum(1)  # noqa: E731
    assert np.abs(share(half, "same_sentence_high") - share(full, "same_sentence_high")).max() < 0.03
    assert np.abs(share(half, "attended_high") - share(full, "attended_high")).max() < 0.03
    rows = full.chance["attn_rows"]
    for key in ("attn_to_cls", "attn_to_sep", "attn_to_punct", "attn_to_self"):
        assert np.abs(half.heads[key] - full.heads[key]).max() / rows < 0.02, key
    assert not np.array_equal(half.heads["sim_sum_high"], full.heads["sim_sum_high"])  # it did run in bf16
