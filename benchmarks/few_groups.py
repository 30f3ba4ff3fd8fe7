"""How the intervals fare with few replicate groups (why `MIN_GROUPS` = 8 in
service/reports/intervals.py, SPEC §5d).

    python benchmarks/few_groups.py [--corpora 20000] [--seed 1]

Simulated corpora like tests/test_intervals.py's clustered ones (each document its own rate of
"within-sentence" pairs, drawn from Beta(2, 8); 1-60 windows per document; 20-200 pairs per
window), but of 2-39 documents, grouped by document as the default `replicates = document` does.
Printed per number of groups holding windows: how many corpora had it, how often the 95% jackknife
interval held the truth (0.2), the t multiplier, and how far the interval's half-width strays from
its median (the interquartile range over the median: the width itself is an estimate, from G − 1
degrees of freedom). numpy only; about a minute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headatlas.service.engine.results import REPLICATES, document_group  # noqa: E402
from headatlas.service.reports.intervals import MIN_GROUPS, jackknife_halfwidth, t95  # noqa: E402

A, B = 2.0, 8.0
TRUTH = A / (A + B)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    covered: dict[int, list[bool]] = {}
    widths: dict[int, list[float]] = {}
    for sim in range(args.corpora):
        documents = int(rng.integers(2, 40))
        windows = rng.integers(1, 61, size=documents)
        rate = rng.beta(A, B, size=documents)
        pairs = rng.integers(20, 201, size=int(windows.sum()))
        hits = rng.binomial(pairs, np.repeat(rate, windows))
        groups = np.repeat(np.array([document_group(f"s{sim}d{d}") for d in range(documents)]), windows)
        group_hits = np.bincount(groups, hits, REPLICATES)
        group_pairs = np.bincount(groups, pairs, REPLICATES)
        held = group_pairs > 0
        g = int(held.sum())
        if g < 2:
            continue
        theta = hits.sum() / pairs.sum()
        loo = (hits.sum() - group_hits[held]) / (pairs.sum() - group_pairs[held])
        half = jackknife_halfwidth(loo.tolist())
        if half is None:
            continue
        covered.setdefault(g, []).append(abs(theta - TRUTH) <= half)
        widths.setdefault(g, []).append(half)
    print(f"# {args.corpora:,} clustered corpora of 2-39 documents, grouped by document; truth {TRUTH}")
    print(f"{'groups':>6} {'corpora':>8} {'coverage':>9} {'t_G-1':>7} {'width IQR/median':>17}")
    for g in sorted(covered):
        w = np.asarray(widths[g])
        q1, med, q3 = np.percentile(w, [25, 50, 75])
        flag = "  < MIN_GROUPS: flagged unreliable" if g < MIN_GROUPS else ""
        print(
            f"{g:>6} {len(covered[g]):>8,} {np.mean(covered[g]):>9.3f} {t95(g - 1):>7.2f} {(q3 - q1) / med:>17.2f}{flag}"
        )


if __name__ == "__main__":
    main()
