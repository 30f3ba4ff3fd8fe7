"""The replicate schemes (SPEC §5b, §5d) and the mixing methods' names: constants and one parser,
without numpy, for the parameters and the CLI, which load before any array is needed
(``results`` re-exports them beside the payload they describe)."""

from __future__ import annotations

# The mixing methods (service.measures.mixing registers one class for each), in display order: attention is
# always measured (the others are compared with it), attribution is asked for with --attribution,
# the forward-only ones with --mixing.
MIXING_METHODS = ("attention", "attribution", "rollout", "norm", "alti")
FORWARD_MIXING = ("rollout", "norm", "alti")

# Replicate groups (SPEC §5b, §5d): every additive sum is kept per group, so a ratio's jackknife
# interval can be computed from stored sums, also after compaction.
REPLICATES = 16
# Below this many groups holding windows (half of REPLICATES), intervals are flagged as unreliable.
# An interval's width is itself an estimate from G - 1 degrees of freedom. By simulation
# (benchmarks/few_groups.py: clustered corpora grouped by document) the spread of the half-width
# (interquartile range over median) is 0.34 with 16 groups, 0.53 with 8, 0.84 with 4 and 1.3 with
# 2, while t_{G-1, 0.975} grows from 2.13 to 2.36, 3.18 and 12.7; coverage slips from 95% (16) and
# 92-94% (8-15) to 90-93% (3-7).
MIN_GROUPS = 8
# SPEC §5d: a window's group is a hash of its unit: its document (default), a block of B consecutive
# windows of its document, or (the §5b rule, kept to reproduce earlier runs) the window itself
REPLICATE_UNITS = ("document", "block", "window")
FALLBACK_BLOCK = 8  # B of the block rule `document` falls back to on a corpus of few documents
# ``document`` falls back to ``block:FALLBACK_BLOCK`` below this many documents. By simulation on
# clustered corpora (tests/test_intervals.py) the document rule with the t quantile covers 93-97%
# from 10 documents up, and blocks of one document, which split its windows over several groups,
# cover ~60% below 64 (the 4·R of SPEC §5d): blocks measure only the variation within the corpus's
# documents. Below 10 documents the document rule leaves fewer than 10 groups, and t_{R-1} makes
# its intervals too wide to read; there the block rule is given, and its footnote says so.
FALLBACK_BELOW = 10


def parse_replicates(text: str) -> tuple[str, int]:
    """``document`` | ``block:B`` | ``window`` → (unit, B); B = 0 except for blocks. Raises
    ValueError with the expected forms (the parameters turn it into a ParameterError)."""
    unit, sep, raw = str(text).strip().lower().partition(":")
    if unit == "block" and sep and raw.isdigit() and int(raw) >= 1:
        return unit, int(raw)
    if unit in ("document", "window") and not sep:
        return unit, 0
    raise ValueError(f"{text!r}: expected document, block:B (B ≥ 1 consecutive windows, e.g. block:8) or window")
