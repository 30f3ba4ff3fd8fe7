"""Coverage of the lifts' 95% intervals on clustered corpora with few, heavy-tailed contributions
per document (SPEC §5d), on the linear scale and on the log scale.

    python benchmarks/lift_intervals.py [--corpora 4000] [--seed 1]

A lift is a ratio of two sums over windows, observed / chance (`attn_to_punct_lift`:
attention on '.'/',' over its uniform expectation; `repetition_words_lift_dm`: word repeats in H
over their distance-matched chance). Simulated corpora of 10-500 documents with 1-60 windows each
(SPEC §5d), grouped by document into 16 replicate groups as `replicates = document` does:

- punct: a document's rate of '.'/',' tokens is heavy-tailed (lognormal, σ = 1: dialogue against
  narration), and so is how much the head attends to them there (lognormal, σ = 0.8); a window's
  chance is its punctuation count, its observed weight that count times the document's lift.
- words: a document's rate of repeated words (lognormal, σ = 1) sets the chance, a count of a few
  per window; the observed count is Poisson around chance times the document's own lift
  (lognormal, σ = 0.8).

The true lift is 1.3 in both (the document effects have mean 1 and are independent of the rates).
Printed per metric: how often the interval held the truth, on the linear scale (the jackknife of
the lift, the rule before) and on the log scale (the jackknife of log lift, its interval
exponentiated: the delta method on the log of the ratio), and the spread of the difference of two
disjoint halves of each corpus (split by document) over what their intervals allow
(sd of (A − B) / sqrt(se_A² + se_B²); 1 where the intervals are right, the check of SPEC §5d (2)).
numpy only; about two minutes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headatlas.service.reports.intervals import t95  # noqa: E402

REPLICATES = 16
TRUTH = 1.3


def _corpus(rng: np.random.Generator, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per document: observed sum, chance sum and replicate group."""
    documents = int(np.exp(rng.uniform(np.log(10), np.log(500))))
    windows = rng.integers(1, 61, size=documents)
    effect = rng.lognormal(-0.32, 0.8, size=documents)  # mean 1
    if kind == "punct":
        rate = rng.lognormal(np.log(12.0) - 0.5, 1.0, size=documents)  # '.'/',' per window
        chance = rng.poisson(rate * windows).astype(float)
        observed = chance * TRUTH * effect * rng.lognormal(-0.02, 0.2, size=documents)
    else:
        rate = rng.lognormal(np.log(3.0) - 0.5, 1.0, size=documents)  # chance repeats per window
        chance = rate * windows
        observed = rng.poisson(chance * TRUTH * effect).astype(float)
    groups = rng.integers(0, REPLICATES, size=documents)
    return observed, chance, groups


def _interval(observed: np.ndarray, chance: np.ndarray, groups: np.ndarray) -> dict[str, tuple[float, float, float]]:
    """(estimate, standard error, t multiplier) per scale; the log scale's on log lift."""
    obs_g = np.bincount(groups, observed, REPLICATES)
    chance_g = np.bincount(groups, chance, REPLICATES)
    held = chance_g > 0
    theta = observed.sum() / chance.sum()
    loo = (observed.sum() - obs_g[held]) / (chance.sum() - chance_g[held])
    r = len(loo)
    t = t95(r - 1)
    out = {"linear": (theta, np.sqrt((r - 1) / r * ((loo - loo.mean()) ** 2).sum()), t)}
    if theta > 0 and (loo > 0).all():
        log_loo = np.log(loo)
        out["log"] = (np.log(theta), np.sqrt((r - 1) / r * ((log_loo - log_loo.mean()) ** 2).sum()), t)
    else:
        out["log"] = (np.nan, np.nan, t)
    return out


def _covers(estimate: float, se: float, t: float, scale: str) -> bool:
    truth = np.log(TRUTH) if scale == "log" else TRUTH
    return bool(abs(estimate - truth) <= t * se)


def simulate(corpora: int, seed: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    results: dict[str, dict[str, float]] = {}
    by_size: dict[str, list] = {"punct": [], "words": []}
    for kind in ("punct", "words"):
        cover = {"linear": [], "log": []}
        z = {"linear": [], "log": []}
        for _ in range(corpora):
            observed, chance, groups = _corpus(rng, kind)
            if chance.sum() == 0 or len(set(groups.tolist())) < 8:
                continue
            whole = _interval(observed, chance, groups)
            for scale in cover:
                cover[scale].append(_covers(*whole[scale], scale))
            by_size[kind].append((len(observed), _covers(*whole["linear"], "linear"), _covers(*whole["log"], "log")))
            half = rng.random(len(observed)) < 0.5
            if min(len(set(groups[half].tolist())), len(set(groups[~half].tolist()))) < 8:
                continue
            if chance[half].sum() == 0 or chance[~half].sum() == 0:
                continue
            a = _interval(observed[half], chance[half], groups[half])
            b = _interval(observed[~half], chance[~half], groups[~half])
            for scale in cover:
                z[scale].append((a[scale][0] - b[scale][0]) / np.hypot(a[scale][1], b[scale][1]))
        results[kind] = {
            **{f"coverage_{s}": float(np.mean(cover[s])) for s in cover},
            **{f"halves_spread_{s}": float(np.nanstd(z[s])) for s in z},
            "corpora": len(cover["linear"]),
        }
    for kind, rows in by_size.items():
        arr = np.array(rows, dtype=float)
        for lo, hi in ((10, 30), (30, 100), (100, 501)):
            sel = (arr[:, 0] >= lo) & (arr[:, 0] < hi)
            results[kind][f"linear_{lo}-{hi - 1}"] = float(arr[sel, 1].mean())
            results[kind][f"log_{lo}-{hi - 1}"] = float(arr[sel, 2].mean())
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    results = simulate(args.corpora, args.seed)
    print(f"# clustered corpora (10-500 documents, 1-60 windows each), grouped by document; truth {TRUTH}")
    print(f"{'metric':<8} {'corpora':>8} {'cover lin':>10} {'cover log':>10} {'halves lin':>11} {'halves log':>11}")
    for kind, r in results.items():
        print(kind, {k: round(v, 3) for k, v in r.items() if "-" in k})
    for kind, r in results.items():
        print(
            f"{kind:<8} {r['corpora']:>8,} {r['coverage_linear']:>10.3f} {r['coverage_log']:>10.3f} "
            f"{r['halves_spread_linear']:>11.2f} {r['halves_spread_log']:>11.2f}"
        )


if __name__ == "__main__":
    main()
