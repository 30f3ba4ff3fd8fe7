"""What ``analyze --effects`` says it will cost, against what it costs (target: within 1.5x).

    python benchmarks/effect_estimate.py [--model default] [--windows 8] [--kinds zero,mean]
                                         [--seq-len 128] [--reference 256] [--repeats 3]

Per repeat, in one process and interleaved (the machine's load hits both alike): a fresh model is
loaded, as ``analyze`` loads it, and the effects measure's estimate is made on the run's first
``--windows`` windows of the shipped excerpt, as ``analyze`` makes it before it starts; then the
work it estimates is done and timed: the reference means over the corpus's first ``--reference``
windows (fewer where the corpus has fewer) and every effect window's ablations, one window per
batch (as ``analyze`` runs them on a CPU). Printed: the estimate, the time taken, and their ratio
(median of the repeats, with the range).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.common import median  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.engine.run_plan import first_windows  # noqa: E402
from headatlas.service.engine.windows import TokenClasses, collate  # noqa: E402
from headatlas.service.measures.effect_batch import effect_sums, estimate, reference_means  # noqa: E402
from headatlas.service.params import AnalysisParams  # noqa: E402

EXCERPT = Path(__file__).resolve().parents[1] / "service" / "data" / "wiki_excerpt.txt"


def one_repeat(args) -> tuple[float, float, str]:
    model = load_model(args.model, device="cpu")
    params = AnalysisParams(
        seq_len=args.seq_len,
        effects=tuple(args.kinds.split(",")),
        effect_windows=args.windows,
        effect_reference=args.reference,
    )
    tokens = TokenClasses.for_model(model)
    upcoming = first_windows(str(EXCERPT), model, params, tokens, args.windows)
    reference = first_windows(str(EXCERPT), model, params, tokens, params.effect_reference)
    began = time.perf_counter()
    cost = estimate(model, params, upcoming, len(upcoming), tokens.pad_id, reference=len(reference))
    estimating = time.perf_counter() - began

    began = time.perf_counter()
    means = reference_means(model, reference, tokens.pad_id) if "mean" in params.effects else None
    for window in upcoming:  # one window per batch, as analyze runs them on a CPU
        effect_sums(
            model,
            collate([window], tokens.pad_id),
            replace(params),
            count=1,
            group=np.zeros(1, dtype=np.int64),
            n_groups=1,
            means=means,
            pad_id=tokens.pad_id,
        )
    taken = time.perf_counter() - began + estimating
    return cost.seconds + cost.timing_s, taken, cost.describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--kinds", default="zero,mean")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reference", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    for k in range(args.repeats):
        said, taken, described = one_repeat(args)
        ratios.append(said / taken)
        print(f"repeat {k + 1}: said {said:.1f} s, took {taken:.1f} s, ratio {said / taken:.2f} ({described})")
    print(
        f"{args.model}, {args.windows} windows, {args.kinds}: estimate / time taken = {median(ratios):.2f}x "
        f"(median of {args.repeats}, range {min(ratios):.2f}-{max(ratios):.2f}; target within 1.5x either way)"
    )


if __name__ == "__main__":
    main()
