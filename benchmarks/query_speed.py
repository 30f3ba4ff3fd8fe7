"""Ingest rate and query latency on a large synthetic run (default: 20,000 windows, 12 × 12 heads).

    python benchmarks/query_speed.py [--windows 20000] [--layers 12] [--heads 12]

The statistics are random but shaped like real ones (same tables, same row counts as a
BERT-base run of that many 128-token windows); what is measured is the store, not the model.
Target: every `query` under 0.5 s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.common import Timer, median  # noqa: E402
from headatlas.service.engine.analysis import BatchResult  # noqa: E402
from headatlas.service.engine.results import HEAD_SUMS, replicate_group  # noqa: E402
from headatlas.service.reports import distance_queries, layer_queries, queries  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402

SEQ = 128


def synthetic_batch(rng, first_window: int, n_windows: int, layers: int, heads: int) -> BatchResult:
    """Random sums shaped like a real batch: kept per replicate group, as the store receives them."""
    k = 158
    windows = [f"w{first_window + i:08d}" for i in range(n_windows)]
    reps, group = np.unique([replicate_group(w) for w in windows], return_inverse=True)
    per_group = np.bincount(group, minlength=len(reps))  # windows in each group
    n_groups = len(reps)
    dist = np.zeros((n_groups, layers, heads, SEQ), dtype=np.int64)
    for g in range(n_groups):
        for l in range(layers):
            d = rng.integers(1, SEQ, size=(heads, per_group[g] * k))
            for h in range(heads):
                dist[g, l, h] = np.bincount(d[h], minlength=SEQ)
    heads_sums = {}
    scale = per_group[:, None, None]
    for name in HEAD_SUMS:
        if name == "high_pairs":
            heads_sums[name] = np.broadcast_to(scale * k, (n_groups, layers, heads)).astype(np.int64)
        elif name.endswith("_high"):
            heads_sums[name] = (rng.random((n_groups, layers, heads)) * scale * k).astype(np.int64)
        elif name in ("anchor_frequent", "anchored_windows"):
            heads_sums[name] = np.broadcast_to(scale, (n_groups, layers, heads)).astype(np.int64)
        else:
            heads_sums[name] = rng.random((n_groups, layers, heads)) * scale * 128
    chance = {
        "windows": per_group,
        "pairs": per_group * 7875,
        "same_sentence_pairs": per_group * 1800,
        "same_token_pairs": per_group * 100,
        "attn_rows": per_group * 128,
        "same_word_pairs": per_group * 60,
        "punct_tokens": per_group * 9,
    }
    pairs = np.stack([np.bincount(rng.integers(1, SEQ, size=n * 7875), minlength=SEQ) for n in per_group])
    pair_hist = {"pairs": pairs, "same_sentence": pairs // 4, "same_token": pairs // 50, "same_word": pairs // 80}
    anchor = rng.integers(1000, 1400, size=(n_windows, layers, heads))
    return BatchResult(
        window_ids=windows,
        reps=reps.astype(np.int16),
        rep_heads=heads_sums,
        rep_dist_hist=dist,
        rep_attended_hist=dist // 2,
        rep_chance={k_: np.asarray(v, dtype=np.int64) for k_, v in chance.items()},
        rep_pair_hist={k_: v.astype(np.int64) for k_, v in pair_hist.items()},
        anchor_token=anchor,
        anchor_count=rng.integers(10, 60, size=anchor.shape).astype(np.int32),
        high_count=np.full(anchor.shape, k, dtype=np.int32),
        anchor_frequent=rng.random(anchor.shape) < 0.3,
        windows=[{"window_id": w, "doc_id": "d", "window_index": i, "n_tokens": 128} for i, w in enumerate(windows)],
        documents=[{"doc_id": "d", "source": "synthetic", "line": 1, "n_chars": 0, "preview": ""}],
        vocab={int(t): f"tok{t}" for t in np.unique(anchor)},
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=20_000)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "q.duckdb")
        store.ensure_schema()
        run, _ = store.find_or_create_run(
            run_key="synthetic",
            name="synthetic",
            corpus="synthetic",
            corpus_fingerprint="-",
            model={
                "spec": "random:bert-base",
                "name": "synthetic",
                "layers": args.layers,
                "heads": args.heads,
                "d_head": 64,
            },
            params={"seq_len": SEQ, "short_range": 4},
            engine="embedded",
            device="cpu",
        )
        n_batches = args.windows // args.batch_size
        group, rows, ingest_s = 20, 0, 0.0
        for start in range(0, n_batches, group):
            items = [
                (b, synthetic_batch(rng, b * args.batch_size, args.batch_size, args.layers, args.heads))
                for b in range(start, min(n_batches, start + group))
            ]
            rows += sum(
                len(i[1].window_ids) * (1 + args.layers * args.heads) + args.layers * args.heads * (2 + SEQ)
                for i in items
            )
            with Timer() as t:
                store.ingest(run.run_id, items)
            ingest_s += t.seconds
        with Timer() as t:
            store.compact(run.run_id)
        print(f"# synthetic run: {n_batches * args.batch_size:,} windows, {args.layers}×{args.heads} heads")
        print(
            f"ingest: {rows:,} rows in {ingest_s:.1f} s = {rows / ingest_s:,.0f} rows/s; compaction {t.seconds:.2f} s"
        )
        calls = {
            "query heads": lambda c: queries.heads(c, run.run_id),
            "query heads --sort": lambda c: queries.heads(c, run.run_id, sort="within_sentence_lift", top=10),
            "query distances": lambda c: distance_queries.distances(c, run.run_id, layer=5, head=3),
            "query boundaries": lambda c: layer_queries.boundaries(c, run.run_id),
            "query layers": lambda c: layer_queries.layers(c, run.run_id),
            "query heads --ci": lambda c: queries.heads(c, run.run_id, ci=True),
            "query layers --ci": lambda c: layer_queries.layers(c, run.run_id, ci=True),
            "query distances --ci": lambda c: distance_queries.distances(
                c, run.run_id, layer=5, head=3, split=True, ci=True
            ),
        }
        print(f"{'query':<22} {'median s':>9} {'max s':>7}  (including opening the database)")
        for name, call in calls.items():
            times = []
            for _ in range(args.repeats):
                with Timer() as t:
                    with store.checked_read() as conn:
                        call(conn)
                times.append(t.seconds)
            print(f"{name:<22} {median(times):>9.3f} {max(times):>7.3f}", flush=True)


if __name__ == "__main__":
    main()
