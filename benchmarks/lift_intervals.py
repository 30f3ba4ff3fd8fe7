"""Coverage of the lifts' 95% intervals on clustered corpora whose documents contribute few,
heavy-tailed sums (SPEC §5d), under three rules, and the spread of two halves' differences.

    python benchmarks/lift_intervals.py [--corpora 2000] [--seed 1] [--alternatives] [--replicates 16]

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
- `fixed-mass`, `dense-attends` (not run unless named): `spec` with the ln of a document's lift
  correlated with the ln of its rate, ρ = −0.7 (a head that puts a fixed mass on '.'/',': its lift
  falls as they grow denser) and ρ = +0.5 (a head that attends more where they are dense); their
  true lift is 1.3 · exp(ρ σ_rate σ_lift);
- `calm`: a well-behaved lift: 10-500 documents, lengths as `chapters`, rate σ = 0.15 (the ln of
  '.'/',' per token varies by 0.12 between wikipedia_dev's articles), the head's lift σ = 0.3.

Rules (`intervals.jackknife_pivot`): `linear`, θ̂ ± t_{R−1} · se(θ) (the rule at §5d's start);
`log`, θ̂ · exp(∓ t_{R−1} · se(ln θ)) (the rule before `lift_df`); `log+df`,
θ̂ · exp(∓ t_df · se(ln θ)), df = `lift_df` (the rule now). Printed per corpus kind and rule:
``--alternatives`` adds rules that were tried and not taken: `log+g2`, df from the plain sample
excess kurtosis g2 instead of the unbiased G2; `log-bc`, centred on the jackknife's bias-corrected
ln θ (ln θ̂ − (R − 1)(mean ln θ_(g) − ln θ̂)) with t_{R−1}; `log-acc`, a BCa-style interval without
the bootstrap (z0 = 0, acceleration a from the jackknife's skewness: bounds ln θ̂ + se · w/(1 − a·w),
w = ∓t_{R−1}). ``--replicates``: groups other than 16 (the store keeps 16; this asks what more would
give). ``--books``: chapters nested in a few books, halves by alternate chapters or by book
(``books``): what the spread of two halves says when the documents are not the sampling unit.
Printed per corpus kind and rule: coverage of the truth, by document count; the share of intervals wholly below the truth; the median
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

REPLICATES = 16  # --replicates changes it
TRUTH = 1.3
KINDS = {
    "spec": {"documents": (10, 500), "length": None, "rate": 1.0, "lift": 0.8},
    "chapters": {"documents": (10, 60), "length": 1.0, "rate": 1.0, "lift": 1.2},
    "calm": {"documents": (10, 500), "length": 1.0, "rate": 0.15, "lift": 0.3},
    # not in the default list: `spec` with the ln of a document's lift correlated with the ln of its rate
    "fixed-mass": {"documents": (10, 500), "length": None, "rate": 1.0, "lift": 0.8, "rho": -0.7},
    "dense-attends": {"documents": (10, 500), "length": None, "rate": 1.0, "lift": 0.8, "rho": 0.5},
}
DEFAULT_KINDS = "spec,chapters,calm"


def truth(kind: str) -> float:
    """The kind's true lift, E[observed] / E[chance]: 1.3 · exp(ρ σ_rate σ_lift) (lognormal)."""
    spec = KINDS[kind]
    return TRUTH * math.exp(spec.get("rho", 0.0) * spec["rate"] * spec["lift"])


RULES = ["linear", "log", "log+df"]
ALTERNATIVES = ["log+g2", "log-bc", "log-acc"]
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
    z = rng.standard_normal(documents)
    rate = np.exp(np.log(12.0) - spec["rate"] ** 2 / 2 + spec["rate"] * z)
    rho = spec.get("rho", 0.0)
    shared = rho * z + math.sqrt(1 - rho * rho) * rng.standard_normal(documents)
    lift = np.exp(-(spec["lift"] ** 2) / 2 + spec["lift"] * shared)  # mean 1
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
    r = len(loo)
    out["log"] = (*out["log+df"][:3], float(r - 1))
    logs = np.log(loo)
    dev = logs - logs.mean()
    s2 = float((dev**2).sum())
    g2 = r * float((dev**4).sum()) / s2**2 - 3 if s2 > 0 else 0.0
    df = min(r - 1.0, max(1.0, 2 / (2 / (r - 1) + max(g2, 0.0) / r)))
    out["log+g2"] = (*out["log+df"][:3], df)
    centre, se = out["log"][1], out["log"][2]
    out["log-bc"] = (True, centre - (r - 1) * (logs.mean() - centre), se, float(r - 1))
    a = float(((-dev) ** 3).sum()) / (6 * s2**1.5) if s2 > 0 else 0.0
    bounds = [w / (1 - a * w) if 1 - a * w > 0 else math.copysign(math.inf, w) for w in (-t95(r - 1), t95(r - 1))]
    out["log-acc"] = (True, centre, se, float(r - 1), bounds)  # asymmetric: multipliers of se
    return out


def _covers(pivot: tuple, true_lift: float) -> tuple[bool, bool, float]:
    """(holds ``true_lift``, lies wholly below it, width over θ̂)."""
    log_scale, centre, se, df, *asymmetric = pivot
    low, high = asymmetric[0] if asymmetric else (-t95(df), t95(df))
    lo, hi = centre + low * se, centre + high * se
    truth = math.log(true_lift) if log_scale else true_lift
    width = (math.exp(hi - centre) - math.exp(lo - centre)) if log_scale else (hi - lo) / centre
    return lo <= truth <= hi, hi < truth, width


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
            rows[rule].append((len(observed), *_covers(whole[rule], truth(kind))))
        half = rng.random(len(observed)) < 0.5
        if min(len(set(groups[half].tolist())), len(set(groups[~half].tolist()))) < 8:
            continue
        a, b = pivots(observed[half], chance[half], groups[half]), pivots(observed[~half], chance[~half], groups[~half])
        if a is None or b is None:
            continue
        for rule in RULES:
            (_, ca, sa, da, *_), (_, cb, sb, db, *_) = a[rule], b[rule]
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


def books(corpora: int, seed: int) -> list[tuple]:
    """Chapters nested in books (``--books``): 4-6 books of 5-15 chapters (lengths lognormal,
    median 15 windows, σ = 1), each book with its own rate of '.'/',' (σ = 0.3) and its own lift
    (σ = ``book``), each chapter its own lift around its book's (σ = 0.5); replicate groups by
    chapter (the document), as a corpus of chapters is grouped. Two halves: alternate chapters
    (every book in both) or whole books in each. Per (books, book σ, split): the spread of
    (A − B) / sqrt(se_A² + se_B²) and the share passing the difference test, under ``log+df``."""
    rng = np.random.default_rng(seed)
    out = []
    for n_books, book_sigma in ((4, 0.0), (4, 0.3), (6, 0.3), (6, 0.5)):
        found: dict[str, list] = {"alternate chapters": [], "by book": []}
        for _ in range(corpora):
            per = rng.integers(5, 16, size=n_books)
            book = np.repeat(np.arange(n_books), per)
            n = len(book)
            windows = np.maximum(1, np.round(rng.lognormal(np.log(15.0), 1.0, size=n)))
            rate = 12.0 * rng.lognormal(0.0, 0.3, size=n_books)[book] * rng.lognormal(-0.02, 0.2, size=n)
            lift = rng.lognormal(-(book_sigma**2) / 2, book_sigma, size=n_books)[book] * rng.lognormal(
                -0.125, 0.5, size=n
            )
            chance = rng.poisson(rate * windows).astype(float)
            observed = chance * TRUTH * lift
            groups = rng.integers(0, REPLICATES, size=n)
            for split, half in (("alternate chapters", np.arange(n) % 2 == 0), ("by book", book < n_books // 2)):
                if min(len(set(groups[half].tolist())), len(set(groups[~half].tolist()))) < 8:
                    continue
                a = pivots(observed[half], chance[half], groups[half])
                b = pivots(observed[~half], chance[~half], groups[~half])
                if a is None or b is None:
                    continue
                (_, ca, sa, da), (_, cb, sb, db) = a["log+df"], b["log+df"]
                var = sa * sa + sb * sb
                df = var * var / (sa**4 / da + sb**4 / db)
                z = (ca - cb) / math.sqrt(var)
                found[split].append((z, abs(z) <= t_quantile(0.975, df)))
        for split, rows in found.items():
            z = np.array(rows, dtype=float)
            out.append((n_books, book_sigma, split, len(z), float(z[:, 0].std()), float(z[:, 1].mean())))
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpora", type=int, default=2000, help="corpora per kind")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kinds", default=DEFAULT_KINDS, help=f"of {', '.join(KINDS)}")
    parser.add_argument("--alternatives", action="store_true", help="also the rules tried and not taken")
    parser.add_argument("--books", action="store_true", help="the halves of chapters nested in books instead")
    parser.add_argument("--replicates", type=int, default=16, help="replicate groups (the store keeps 16)")
    args = parser.parse_args(argv)
    global REPLICATES
    REPLICATES = args.replicates
    if args.alternatives:
        RULES.extend(ALTERNATIVES)
    if args.books:
        print(f"# chapters nested in books, grouped by chapter into {REPLICATES} groups; log+df; seed {args.seed}")
        print(f"{'books':>5} {'book σ':>6}  {'halves':<19} {'corpora':>7} {'sd':>5} {'pass':>6}")
        for n_books, sigma, split, n, sd, passed in books(args.corpora, args.seed):
            print(f"{n_books:>5} {sigma:>6.1f}  {split:<19} {n:>7,} {sd:>5.2f} {100 * passed:>5.1f}%")
        return
    print(
        f"# clustered corpora grouped by document into {REPLICATES} groups; true lift 1.3 (`fixed-mass`, `dense-attends`: {truth('fixed-mass'):.3f}, {truth('dense-attends'):.3f}); seed {args.seed}"
    )
    head = f"{'kind':<13} {'rule':<7} {'corpora':>7} {'cover':>6} " + " ".join(
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
                f"{kind:<13} {rule:<7} {r['corpora']:>7,} {100 * r['coverage']:>5.1f}% {sizes} {100 * r['below']:>5.1f}% "
                f"{r['width']:>6.3f} {r['halves_spread']:>9.2f} {100 * r['halves_pass']:>5.1f}%"
            )


if __name__ == "__main__":
    main()
