"""Coverage of the lifts' 95% intervals on clustered corpora whose documents contribute few,
heavy-tailed sums (SPEC §5d), under three rules, and the spread of two halves' differences.

    python benchmarks/lift_intervals.py [--corpora 2000] [--seed 1]

A lift is a ratio of two sums over windows, observed / chance (`attn_to_punct_lift`: attention on
'.'/',' over its uniform expectation; `repetition_words_lift_dm`: word repeats in H over their
distance-matched chance). Per document: a length in windows, a rate (of '.'/',' tokens or of
chance word repeats per window) and the head's own lift there (mean 1 over documents, independent
of the rate); its chance sum is Poisson(rate · windows), its observed sum chance · 1.3 · lift ·
(a little noise): the true lift is 1.3. Documents fall in 16 replicate groups by a hash, as
`replicates = document` puts them. Corpora:

- `spec`: SPEC §5d's spread, 10-500 documents (log-uniform), 1-60 windows each (uniform), rate
  lognormal σ = 1, the head's lift lognormal σ = 0.8 (the corpora of the first log-scale study);
- `chapters`: held-out chapters: 10-60 documents, lengths lognormal (median 15 windows, σ = 1; the
  articles of wikipedia_dev.txt have σ = 0.95 in ln length), rate σ = 1, the head's lift σ = 1.2:
  a few long, dense chapters carry most of the denominator;
- `calm`: a well-behaved lift: 10-500 documents, lengths as `chapters`, rate σ = 0.15 (the ln of
  '.'/',' per token varies by 0.12 between wikipedia_dev's articles), the head's lift σ = 0.3.

Rules (`intervals.jackknife_pivot`): `linear`, θ̂ ± t_{R−1} · se(θ) (the rule at §5d's start);
`log`, θ̂ · exp(∓ t_{R−1} · se(ln θ)) (the rule before `lift_df`); `log+df`,
θ̂ · exp(∓ t_df · se(ln θ)), df = `lift_df` (the rule now). Printed per corpus kind and rule:
coverage of the truth, by document count; the share of intervals wholly below the truth; the median
width over θ̂; and, for two disjoint halves of each corpus (split by document), the spread of
(A − B) / sqrt(se_A² + se_B²) on the rule's scale (1 where the standard errors are right; t_15's
is 1.07) and the share passing Welch's difference test with the rule's degrees of freedom (95%
expected; SPEC §5d (2), as benchmarks/halves.py). numpy only.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from headatlas.service.reports.intervals import jackknife_pivot, t95, t_quantile  # noqa: E402

REPLICATES = 16
TRUTH = 1.3
KINDS = {
    "spec": {"documents": (10, 500), "length": None, "rate": 1.0, "lift": 0.8},
    "chapters": {"documents": (10, 60), "length": 1.0, "rate": 1.0, "lift": 1.2},
    "calm": {"documents": (10, 500), "length": 1.0, "rate": 0.15, "lift": 0.3},
}
RULES = ("linear", "log", "log+df")
SIZES = ((10, 30), (30, 100), (100, 501))


def corpus(rng: np.random.Generator, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per document of one corpus of ``kind``: observed sum, chance sum, replicate group."""
    spec = KINDS[kind]
    lo, hi = spec["documents"]
    documents = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
    if spec["length"] is None:
        windows = rng.integers(1, 61, size=documents)
    else:
        windows = np.maximum(1, np.round(rng.lognormal(np.log(15.0), spec["length"], size=documents)))
    rate = rng.lognormal(np.log(12.0) - spec["rate"] ** 2 / 2, spec["rate"], size=documents)
    lift = rng.lognormal(-(spec["lift"] ** 2) / 2, spec["lift"], size=documents)  # mean 1
    chance = rng.poisson(rate * windows).astype(float)
    observed = chance * TRUTH * lift * rng.lognormal(-0.02, 0.2, size=documents)
    return observed, chance, rng.integers(0, REPLICATES, size=documents)


def pivots(observed: np.ndarray, chance: np.ndarray, groups: np.ndarray) -> dict[str, tuple] | None:
    """Per rule: (on the log scale, centre, standard error, degrees of freedom), from the
    leave-one-group-out lifts as the store gives them; None where a rule has no interval."""
    obs_g, chance_g = np.bincount(groups, observed, REPLICATES), np.bincount(groups, chance, REPLICATES)
    held = np.bincount(groups, minlength=REPLICATES) > 0
    if chance.sum() == 0 or (chance.sum() - chance_g[held] <= 0).any():
        return None
    theta = observed.sum() / chance.sum()
    loo = ((observed.sum() - obs_g[held]) / (chance.sum() - chance_g[held])).tolist()
    out = {
        "linear": jackknife_pivot("attn_to_punct_lift", theta, loo, log_lifts=False),
        "log+df": jackknife_pivot("attn_to_punct_lift", theta, loo),
    }
    if out["log+df"] is None or not out["log+df"][0]:
        return None
    out["log"] = (*out["log+df"][:3], float(len(loo) - 1))
    return out


def _covers(pivot: tuple) -> tuple[bool, bool, float]:
    """(holds the truth, lies wholly below it, width over θ̂)."""
    log_scale, centre, se, df = pivot
    half = t95(df) * se
    truth = math.log(TRUTH) if log_scale else TRUTH
    width = 2 * math.sinh(half) if log_scale else 2 * half / centre
    return abs(centre - truth) <= half, centre + half < truth, width


def simulate(kind: str, corpora: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {rule: [] for rule in RULES}  # (documents, covers, below, width)
    halves: dict[str, list] = {rule: [] for rule in RULES}  # (z, passes)
    for _ in range(corpora):
        observed, chance, groups = corpus(rng, kind)
        if len(set(groups.tolist())) < 8:  # flagged unreliable (SPEC §5d)
            continue
        whole = pivots(observed, chance, groups)
        if whole is None:
            continue
        for rule in RULES:
            rows[rule].append((len(observed), *_covers(whole[rule])))
        half = rng.random(len(observed)) < 0.5
        if min(len(set(groups[half].tolist())), len(set(groups[~half].tolist()))) < 8:
            continue
        a, b = pivots(observed[half], chance[half], groups[half]), pivots(observed[~half], chance[~half], groups[~half])
        if a is None or b is None:
            continue
        for rule in RULES:
            (_, ca, sa, da), (_, cb, sb, db) = a[rule], b[rule]
            var = sa * sa + sb * sb
            z = (ca - cb) / math.sqrt(var)
            df = var * var / (sa**4 / da + sb**4 / db)  # Welch–Satterthwaite
            halves[rule].append((z, abs(z) <= t_quantile(0.975, df)))
    out = {}
    for rule in RULES:
        arr = np.array(rows[rule], dtype=float)
        z = np.array(halves[rule], dtype=float)
        out[rule] = {
            "corpora": len(arr),
            "coverage": arr[:, 1].mean(),
            "below": arr[:, 2].mean(),
            "width": float(np.median(arr[:, 3])),
            **{
                f"{lo}-{hi - 1}": arr[(arr[:, 0] >= lo) & (arr[:, 0] < hi), 1].mean()
                for lo, hi in SIZES
                if ((arr[:, 0] >= lo) & (arr[:, 0] < hi)).any()
            },
            "halves_spread": float(z[:, 0].std()),
            "halves_pass": float(z[:, 1].mean()),
        }
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", type=int, default=2000, help="corpora per kind")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=",".join(KINDS))
    args = parser.parse_args(argv)
    print(f"# clustered corpora grouped by document into {REPLICATES} groups; truth {TRUTH}; seed {args.seed}")
    head = f"{'kind':<9} {'rule':<7} {'corpora':>7} {'cover':>6} " + " ".join(
        f"{f'{lo}-{hi - 1}':>7}" for lo, hi in SIZES
    )
    print(head + f" {'below':>6} {'width':>6} {'halves sd':>9} {'pass':>6}")
    for kind in args.kinds.split(","):
        results = simulate(kind, args.corpora, args.seed)
        for rule, r in results.items():
            sizes = " ".join(
                f"{100 * r[f'{lo}-{hi - 1}']:>6.1f}%" if f"{lo}-{hi - 1}" in r else f"{'—':>7}" for lo, hi in SIZES
            )
            print(
                f"{kind:<9} {rule:<7} {r['corpora']:>7,} {100 * r['coverage']:>5.1f}% {sizes} {100 * r['below']:>5.1f}% "
                f"{r['width']:>6.3f} {r['halves_spread']:>9.2f} {100 * r['halves_pass']:>5.1f}%"
            )


if __name__ == "__main__":
    main()
