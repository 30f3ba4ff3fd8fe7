"""Bare forward pass vs the full analysis (hooks, statistics, storage), ms per window.

    python benchmarks/forward_vs_full.py [--models default random:bert-base] [--windows 256]

Each repeat times, on the same windows and batch size: (a) the model's forward pass alone,
eager attention, inference mode; (b) `analyze_corpus` end to end into a fresh DuckDB file
(tokenisation, forward with hooks, statistics, ingest). Medians over repeats; the ratio is
(b) / (a) measured in the same run. Target on CPU: ≤ 1.3. Unless --no-naive, every repeat also
times (c) a naive baseline (benchmarks/naive.py: numpy per window and per head on
output_attentions) and prints the median over repeats of (c) / (b), the speed-up.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Timer, corpus_prefix, default_corpus, machine, median  # noqa: E402
from benchmarks.naive import naive_batch_statistics  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.engine.run_plan import iter_batches, survey_corpus
from headatlas.service.engine.windows import TokenClasses  # noqa: E402
from headatlas.service.operations.embedded_run import analyze_corpus  # noqa: E402
from headatlas.service.params import AnalysisParams  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402


def bench_model(
    spec: str, corpus: Path, *, batch_size: int, repeats: int, device: str, dtype: str, naive: bool = True
) -> dict:
    model = load_model(spec, device=device, dtype=dtype)
    params = AnalysisParams(dtype=dtype)
    tokens = TokenClasses.for_model(model)  # a decoder's windows: BOS, no SEP
    batches = [b for b, _, _ in iter_batches(str(corpus), model, params, tokens, batch_size=batch_size)]
    windows = sum(len(b.windows) for b in batches)
    summary = survey_corpus(str(corpus))

    def bare():
        with torch.inference_mode(), model.autocast():
            for b in batches:
                model.model(input_ids=b.input_ids.to(model.device), attention_mask=b.attention_mask.to(model.device))
        if model.device.type == "cuda":
            torch.cuda.synchronize()

    def fresh_store(tmp: Path, k: int) -> Store:
        store = Store(tmp / f"bench-{k}.duckdb")
        store.ensure_schema()  # one-time set-up of a database, not part of an analysis
        return store

    def full(store: Store):
        analyze_corpus(str(corpus), store=store, model=model, params=params, corpus=summary, batch_size=batch_size)

    def naive_pass():
        for b in batches:
            naive_batch_statistics(model, b, tokens)

    naive = naive and device == "cpu"
    bare()  # warm-up
    bare_s, full_s, naive_s = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        full(fresh_store(Path(tmp), -1))  # warm-up
        for k in range(repeats):  # interleaved, so drifts in machine load hit all of them
            with Timer() as t:
                bare()
            bare_s.append(t.seconds)
            store = fresh_store(Path(tmp), k)
            with Timer() as t:
                full(store)
            full_s.append(t.seconds)
            if naive:
                with Timer() as t:
                    naive_pass()
                naive_s.append(t.seconds)
    bare_ms = median(bare_s) / windows * 1000
    full_ms = median(full_s) / windows * 1000
    ratios = sorted(f / b for f, b in zip(full_s, bare_s))
    row = {
        "model": spec,
        "windows": windows,
        "bare_ms": bare_ms,
        "full_ms": full_ms,
        "ratio": full_ms / bare_ms,
        "ratio_min": ratios[0],
        "ratio_max": ratios[-1],
        "naive_ms": float("nan"),
        "speedup": float("nan"),
    }
    if naive:
        row["naive_ms"] = median(naive_s) / windows * 1000
        row["speedup"] = median([n / f for n, f in zip(naive_s, full_s)])  # per repeat, then the median
    return row


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["default", "random:bert-base"])
    parser.add_argument("--windows", type=int, default=256, help="about this many 128-token windows")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--no-naive", action="store_true", help="skip the (slow) naive baseline")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus_prefix(default_corpus(), args.windows * 600, Path(tmp) / "bench.txt")
        print(
            f"# {machine()}; {torch.get_num_threads()} threads; batch {args.batch_size}; seq_len 128; "
            f"{args.device} {args.dtype}; medians of {args.repeats}"
        )
        print(
            f"{'model':<20} {'windows':>7} {'bare ms/win':>12} {'full ms/win':>12} {'ratio':>6} {'(range)':>11} "
            f"{'naive ms/win':>13} {'speed-up':>9}"
        )
        rows = []
        for spec in args.models:
            r = bench_model(
                spec,
                corpus,
                batch_size=args.batch_size,
                repeats=args.repeats,
                device=args.device,
                dtype=args.dtype,
                naive=not args.no_naive,
            )
            rows.append(r)
            print(
                f"{spec:<20} {r['windows']:>7} {r['bare_ms']:>12.2f} {r['full_ms']:>12.2f} {r['ratio']:>6.2f} "
                f"{'(%.2f–%.2f)' % (r['ratio_min'], r['ratio_max']):>11} {r['naive_ms']:>13.2f} "  # noqa: UP031
                f"{r['speedup']:>8.2f}×",
                flush=True,
            )
            if r["windows"] < args.windows // 2:  # e.g. only the shipped excerpt, away from ../shared
                print(
                    f"  note: the corpus gave {r['windows']} windows of about {args.windows} asked: a run's fixed "
                    "costs (opening the database, compaction) weigh in the full figure as they would not at that size"
                )
    return rows


if __name__ == "__main__":
    main()
