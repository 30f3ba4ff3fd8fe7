"""The seed paper's pruning claim, tested (SPEC §9): does a head's noise_share say it can go?

    python benchmarks/seed_claim.py [--model default] [--corpus PATH] [--max-chars 60000]
                                    [--windows 16] [--step 10%] [--seeds 3] [--out docs/effects.md]

Analyses the first ``--max-chars`` characters of the corpus (the development corpus where it
exists, else the shipped excerpt) into a fresh database, then runs ``headatlas prune`` on that run:
heads removed cumulatively (mean ablation) by measured effect, by gradient importance (losses only),
by noise_share (largest first) and at random, the objective after each step with its interval,
and the claim's two tests (area between the noise curve and the random ones; Spearman's ρ between
noise_share and the effect). Prints a markdown section and writes the figure beside ``--out``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import corpus_prefix, default_corpus, machine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="default")
    parser.add_argument("--corpus", type=Path, default=None)
    parser.add_argument("--max-chars", type=int, default=60_000)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--step", default="10%")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "seed-claim")
    parser.add_argument("--figure", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.corpus or default_corpus()
    corpus = corpus_prefix(source, args.max_chars, args.work / "corpus.txt")
    db = args.work / f"{args.model.replace(':', '-')}.duckdb"
    db.unlink(missing_ok=True)
    figure = args.figure or args.work / f"prune-{args.model.replace(':', '-')}.png"
    exe = [sys.executable, "-m", "headatlas.cli.main"]
    began = time.perf_counter()
    subprocess.run([*exe, "analyze", str(corpus), "--model", args.model, "--db", str(db), "-q"], check=True)
    analysed = time.perf_counter() - began
    done = subprocess.run(
        [
            *exe,
            "prune",
            "--db",
            str(db),
            "--windows",
            str(args.windows),
            "--step",
            args.step,
            "--seeds",
            str(args.seeds),
            "--format",
            "json",
            "--out",
            str(figure),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    rows = json.loads(done.stdout)
    claim = [line for line in done.stderr.splitlines() if "area between" in line or "Spearman" in line]
    print(f"## The seed's pruning claim: {args.model} on {source.name} (first {args.max_chars:,} characters)\n")
    print(f"{machine()}; analysed in {analysed:.0f} s, pruned in {time.perf_counter() - began - analysed:.0f} s.\n")
    print("| order | heads removed | increase of the objective [95% interval] |")
    print("|---|---|---|")
    for row in rows:
        if row["step"] % 2 == 0 or row["fraction"] == 1:
            interval = f"{row['increase']:+.4g} [{row['increase_lo']:+.4g}, {row['increase_hi']:+.4g}]"
            print(f"| {row['order']} | {row['heads_removed']} ({100 * row['fraction']:.0f}%) | {interval} |")
    print()
    for line in claim:
        print(line.removeprefix("note: "))
    print(f"\nFigure: {figure}")


if __name__ == "__main__":
    main()
