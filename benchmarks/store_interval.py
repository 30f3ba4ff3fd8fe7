"""How often the embedded engine stores its finished batches: a whole run at one interval
against another, in one process.

    python benchmarks/store_interval.py [--model default] [--windows 256] [--rounds 4] [--against 2]

Each store opens the database, writes one transaction and closes it, and the close checkpoints;
storing less often does that less. Each round runs ``analyze_corpus`` into a fresh database with
the engine's interval (``FLUSH_S``) and with ``--against`` seconds, back to back, the order
alternating, so that drifts in machine load hit both sides. The figure is the median over rounds
of (now / against).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import corpus_prefix, default_corpus, machine, median  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--windows", type=int, default=256, help="about this many windows of the corpus")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--against", type=float, default=2.0, help="the other interval, seconds")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import survey_corpus
    from headatlas.service.operations.embedded_run import FLUSH_S, analyze_corpus
    from headatlas.service.params import AnalysisParams
    from headatlas.service.storage.store import Store

    model = load_model(args.model, device="cpu")
    params = AnalysisParams()
    seconds: dict[float, list[float]] = {FLUSH_S: [], args.against: []}
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus_prefix(default_corpus(), args.windows * 620, Path(tmp) / "corpus.txt")
        summary = survey_corpus(str(corpus))
        for k in range(args.rounds):
            for flush_s in (FLUSH_S, args.against) if k % 2 else (args.against, FLUSH_S):
                store = Store(Path(tmp) / f"{k}-{flush_s}.duckdb")
                store.ensure_schema()  # one-time set-up of a database, not part of an analysis
                start = time.perf_counter()
                analyze_corpus(str(corpus), store=store, model=model, params=params, corpus=summary, flush_s=flush_s)
                seconds[flush_s].append(time.perf_counter() - start)
            print(
                f"round {k + 1}: every {FLUSH_S:g} s {seconds[FLUSH_S][-1]:.1f} s, every {args.against:g} s "
                f"{seconds[args.against][-1]:.1f} s"
            )
    print(f"# {args.model}, {summary.documents} documents, {args.threads} threads, {args.rounds} rounds; {machine()}")
    ratio = median([a / b for a, b in zip(seconds[FLUSH_S], seconds[args.against])])
    print(f"a whole run storing every {FLUSH_S:g} s / every {args.against:g} s: {ratio:.2f}x (median of rounds)")


if __name__ == "__main__":
    main()
