"""`analyze --attribution`: the estimate it says before starting against what the run then took.

Runs the embedded engine twice on the same short corpus (the first documents of the shipped text),
without and with ``--attribution`` on ``--windows`` windows; the attribution's actual time is the
difference of the two, its actual memory the peak resident memory above what the process held
before it started (sampled every 20 ms).

    python benchmarks/attribution_estimate.py --seq-len 32 --windows 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from benchmarks.common import corpus_prefix  # noqa: E402
from headatlas.service.analysis_options import ATTRIBUTION_WINDOWS, build_params  # noqa: E402
from headatlas.service.engine.corpus import demo_corpus_path  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.engine.run_plan import survey_corpus
from headatlas.service.errors import FLAGS, render  # noqa: E402
from headatlas.service.measures.attribution import resident_bytes  # noqa: E402
from headatlas.service.operations.embedded_run import analyze_corpus  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402


class PeakMemory:
    """The highest resident memory seen while the block runs."""

    def __enter__(self):
        self.peak, self._stop = resident_bytes() or 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, resident_bytes() or 0)

    def __exit__(self, *_exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--windows", type=int, default=ATTRIBUTION_WINDOWS)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--chars", type=int, default=1500, help="corpus size (the forward statistics' share)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    with tempfile.TemporaryDirectory(prefix="headatlas-bench-") as tmp:
        corpus = corpus_prefix(demo_corpus_path(), args.chars, Path(tmp) / "corpus.txt")
        summary = survey_corpus(str(corpus))
        walls, peaks, said = {}, {}, []
        for attribution in (False, True):
            params = build_params(seq_len=args.seq_len, attribution=attribution, attribution_windows=args.windows)
            store = Store(Path(tmp) / f"{attribution}.duckdb")
            before = resident_bytes() or 0
            with PeakMemory() as peak:
                started = time.perf_counter()
                analyze_corpus(str(corpus), store=store, model=model, params=params, corpus=summary, notice=said.append)
                walls[attribution] = time.perf_counter() - started
            peaks[attribution] = (peak.peak - before) / 2**20
    print(f"model {model.name}, {args.windows} windows × ≤{args.seq_len} tokens, {args.threads} threads")
    print(render(said[0], FLAGS))
    print(
        f"actual: {walls[True] - walls[False]:.1f} s of attribution ({walls[True]:.1f} s with, {walls[False]:.1f} s "
        f"without); peak memory above the process before the run: {peaks[True]:.0f} MB with, "
        f"{peaks[False]:.0f} MB without"
    )


if __name__ == "__main__":
    main()
