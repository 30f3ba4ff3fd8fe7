"""Do the intervals hold on a real corpus? Two disjoint halves of one corpus, split by document,
analysed apart (SPEC §5d (2)).

    python benchmarks/halves.py [CORPUS] [--model default] [--max-chars 6000] [--replicates document]

CORPUS: a .txt corpus of documents separated by blank lines (default ../shared/corpora/wikipedia_dev.txt
beside the repository). Documents alternate between half A (0, 2, 4, …) and half B (1, 3, 5, …);
``--max-chars`` keeps each document's first paragraphs up to about that many characters (0: whole
documents), so the run fits a small machine. Each half is analysed in this process with the given
model and default analysis options, into a fresh database.

Printed, over 72 heads (MiniLM) × the ratio metrics below:
- the share of (head, metric) cells whose A − B difference test passes: |θ_A − θ_B| ≤
  t · sqrt(se_A² + se_B²), se = the jackknife standard error of each half on its interval's scale
  (a lift's: ln θ) (t: Welch's degrees of freedom from each half's, R − 1 or a lift's ``lift_df``,
  SPEC §5d). The halves are independent samples of documents with the same truth, so 95% should
  pass (target 92–98%). Not `compare`'s test of two independent runs, which combines the two half-widths
  (sqrt(h_A² + h_B²), each h at its own run's t): with as many groups in both halves Welch's t is never
  larger, so this interval is never wider and its pass rate a lower bound for compare's (docs/baselines.md);
- the share of cells whose value on half A lies in half B's 95% interval (about 87% expected when the
  intervals are right and both halves have 16 groups: P(|Z| ≤ 2.131/√2), the two halves' errors add).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import machine  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpora" / "wikipedia_dev.txt"
METRICS = (
    "within_sentence",
    "within_sentence_lift_dm",
    "repetition_words",
    "mean_distance",
    "short_range_share",
    "noise_share",
    "attn_to_cls",
    "attn_to_sep",
    "attn_to_punct",
    "attn_to_self",
    "attn_entropy",
    "anchor_frequency_share",
    "attn_to_punct_lift",
    "repetition_words_lift_dm",
)


def split_halves(corpus: Path, out: Path, max_chars: int) -> tuple[Path, Path, int, int]:
    """Write half A (even documents) and half B (odd ones) as .txt corpora; each document cut to
    its first paragraphs up to about ``max_chars`` characters (0: whole)."""
    docs = [d.strip() for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]
    if max_chars:
        cut = []
        for doc in docs:
            kept, size = [], 0
            for paragraph in doc.split("\n"):
                if kept and size + len(paragraph) > max_chars:
                    break
                kept.append(paragraph)
                size += len(paragraph)
            cut.append("\n".join(kept))
        docs = cut
    paths = out / "half_a.txt", out / "half_b.txt"
    for path, part in zip(paths, (docs[0::2], docs[1::2])):
        path.write_text("\n\n".join(part) + "\n", encoding="utf-8")
    return paths[0], paths[1], len(docs[0::2]), len(docs[1::2])


def estimates(db: Path, run_id: int) -> tuple[dict[tuple[int, int, str], tuple[float, float, float]], str, int]:
    """(layer, head, metric) → (value, jackknife standard error, degrees of freedom) on the scale
    of the metric's interval (a lift's: ln, with ``intervals.lift_df``; SPEC §5d), the run's
    replicate scheme and windows."""
    from sqlalchemy import text

    from headatlas.service.reports.intervals import jackknife_pivot, scheme_of
    from headatlas.service.storage.db import transaction
    from headatlas.service.storage.store import Store

    run = Store(db).get_run(run_id)
    cols = ", ".join(METRICS)
    with transaction(db, read_only=True) as conn:
        rows = conn.execute(
            text(f"SELECT layer, head, drop_rep, {cols} FROM head_metrics_reps WHERE run_id = :r"), {"r": run_id}
        ).all()
        windows = conn.execute(text("SELECT count(*) FROM run_windows WHERE run_id = :r"), {"r": run_id}).scalar()
    whole: dict[tuple[int, int], tuple] = {}
    loo: dict[tuple[int, int], list[tuple]] = {}
    for layer, head, drop, *values in rows:
        (whole.__setitem__((layer, head), values) if drop == -1 else loo.setdefault((layer, head), []).append(values))
    out = {}
    for key, values in whole.items():
        groups = loo.get(key, [])
        r = len(groups)
        for m, metric in enumerate(METRICS):
            loo_m = [g[m] for g in groups]
            if values[m] is None or r < 2 or any(v is None for v in loo_m):
                continue
            pivot = jackknife_pivot(metric, float(values[m]), loo_m)
            if pivot is not None:
                out[(*key, metric)] = (pivot[1], pivot[2], pivot[3])
    return out, scheme_of(run.params), int(windows)


def compare_halves(a: dict, b: dict) -> tuple[float, float, int, dict[str, tuple[float, float]]]:
    """(share of cells passing the difference test, share of A's values inside B's interval, cells,
    per metric both shares)."""
    from headatlas.service.reports.intervals import t95, t_quantile

    passed = inside = cells = 0
    by_metric: dict[str, list[int]] = {m: [0, 0, 0] for m in METRICS}
    for key in sorted(set(a) & set(b)):
        (va, sa, da), (vb, sb, db) = a[key], b[key]
        var = sa * sa + sb * sb
        if var == 0:
            continue
        # Welch–Satterthwaite degrees of freedom for the difference of two jackknife estimates
        df = var * var / ((sa**4) / da + (sb**4) / db)
        ok = abs(va - vb) <= t_quantile(0.975, df) * math.sqrt(var)
        within = abs(va - vb) <= t95(db) * sb
        cells += 1
        passed += ok
        inside += within
        counts = by_metric[key[2]]
        counts[0] += ok
        counts[1] += within
        counts[2] += 1
    shares = {m: (c[0] / c[2], c[1] / c[2]) for m, c in by_metric.items() if c[2]}
    return passed / cells, inside / cells, cells, shares


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("corpus", nargs="?", default=str(DEFAULT_CORPUS))
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-chars", type=int, default=6000, help="characters kept per document (0: all)")
    parser.add_argument("--replicates", default="document", help="document, block:B or window")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)
    corpus = Path(args.corpus)
    if not corpus.is_file():
        sys.exit(
            f"error: no corpus at {corpus}: pass the path of a .txt corpus of documents separated by blank lines "
            "(python benchmarks/halves.py PATH)"
        )
    import headatlas

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        half_a, half_b, n_a, n_b = split_halves(corpus, Path(tmp), args.max_chars)
        found = []
        for half in (half_a, half_b):
            db = Path(tmp) / f"{half.stem}.duckdb"
            run = headatlas.analyze(
                half, db=db, model=args.model, batch_size=args.batch_size, replicates=args.replicates
            )
            found.append(estimates(db, run.run_id))
    (a, scheme_a, windows_a), (b, scheme_b, windows_b) = found
    passed, inside, cells, shares = compare_halves(a, b)
    print(f"date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {machine()}")
    print(f"corpus: {corpus} ({args.max_chars or 'all'} characters per document)")
    print(f"half A: {n_a} documents, {windows_a} windows, groups by {scheme_a}")
    print(f"half B: {n_b} documents, {windows_b} windows, groups by {scheme_b}")
    print(f"{'metric':<26} difference test passes   A inside B's interval")
    for metric, (p, i) in shares.items():
        print(f"{metric:<26} {100 * p:6.1f}%                  {100 * i:6.1f}%")
    print(f"A−B difference test passes: {100 * passed:.1f}% of {cells} (head, metric) cells (target 92–98%)")
    print(f"A's value inside B's 95% interval: {100 * inside:.1f}% of cells (about 87% expected)")
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
