"""Cost of the SPEC §5b sums: the full per-batch analysis now against the same code before them.

    python benchmarks/baselines_overhead.py [--against REV] [--model default] [--windows 128] [--rounds 5]

``REV`` (default: the last commit before §5b) is checked out into a temporary git worktree. Each
round runs one child process in each tree (order alternating), which loads the model, cuts the
same windows and times ``analyze_batch`` over all batches (best of 3 passes, after a warm-up).
The figure is the median over rounds of (now / before), so drifts in machine load hit both
sides. Target: ≤ 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import corpus_prefix, default_corpus, median  # noqa: E402

BEFORE_BASELINES = "dd9aa41"  # migration 0005, the commit before the §5b sums

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[4]))
from headatlas.service.engine.analysis import analyze_batch
from headatlas.service.engine.model import load_model
from headatlas.service.params import AnalysisParams
from headatlas.service.engine.run_plan import iter_batches
from headatlas.service.engine.windows import TokenClasses

model = load_model(sys.argv[1], device="cpu")
params = AnalysisParams(sentences="punct")  # the same sentences on both sides: only the §5b sums differ
tokens = TokenClasses.from_tokenizer(model.tokenizer)
batches = [b for b, _, _ in iter_batches(sys.argv[2], model, params, tokens, batch_size=int(sys.argv[3]))]
analyze_batch(model, batches[0], params, tokens)  # warm-up
best = float("inf")
for _ in range(3):
    start = time.perf_counter()
    for b in batches:
        analyze_batch(model, b, params, tokens)
    best = min(best, time.perf_counter() - start)
print(json.dumps({"seconds": best, "windows": sum(len(b.windows) for b in batches)}))
"""


def child(tree: Path, model: str, corpus: Path, batch_size: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(corpus), str(batch_size), str(threads)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"benchmark child in {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default=BEFORE_BASELINES, help="git revision to compare with")
    parser.add_argument("--model", default="default")
    parser.add_argument("--windows", type=int, default=128, help="about this many windows of the corpus")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.against], check=True
        )
        try:
            corpus = corpus_prefix(default_corpus(), args.windows * 620, Path(tmp) / "corpus.txt")
            now_s, before_s, windows = [], [], 0
            for k in range(args.rounds):
                order = [("now", ROOT), ("before", before)]
                for label, tree in order if k % 2 == 0 else reversed(order):
                    out = child(tree, args.model, corpus, args.batch_size, args.threads)
                    (now_s if label == "now" else before_s).append(out["seconds"])
                    windows = out["windows"]
                print(
                    f"round {k + 1}: now {now_s[-1] / windows * 1000:.1f} ms/window, "
                    f"before {before_s[-1] / windows * 1000:.1f} ms/window",
                    flush=True,
                )
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    ratios = sorted(n / b for n, b in zip(now_s, before_s))
    print(
        f"# {args.model}, {windows} windows, batch {args.batch_size}, {args.threads} threads, "
        f"{args.rounds} rounds; against {args.against}"
    )
    print(
        f"analysis per window: now {median(now_s) / windows * 1000:.1f} ms, "
        f"before §5b {median(before_s) / windows * 1000:.1f} ms"
    )
    print(f"overhead of the §5b sums: {median(ratios):.3f}x (range {ratios[0]:.3f}-{ratios[-1]:.3f}; target <= 1.05)")


if __name__ == "__main__":
    main()
