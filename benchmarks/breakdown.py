"""Where the time of a full analysis goes, on one machine, in one run.

    python benchmarks/breakdown.py [--model default] [--batch-size 32] [--repeats 5]

Prints, for batches of 128-token windows: the bare forward pass, the forward pass with the
capture hooks and a no-op callback, and `analyze_batch` (hooks + statistics), each as ms per
batch and as a ratio to the bare pass (interleaved, medians); then the statistics of one layer
split into their parts (similarity matrix, top-k selection, attention sums and the entropy inside
them, all of `head_statistics`), tokenisation per window, and the wall time of a one-window run
into a fresh database (the per-run fixed cost).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Timer, corpus_prefix, default_corpus, forward_passes, machine, median  # noqa: E402
from headatlas.service.engine import features, pair_selection, stats  # noqa: E402
from headatlas.service.engine.analysis import forward  # noqa: E402
from headatlas.service.engine.hooks import act_name  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.engine.run_plan import iter_batches, survey_corpus
from headatlas.service.engine.windows import TokenClasses  # noqa: E402
from headatlas.service.operations.embedded_run import analyze_corpus  # noqa: E402
from headatlas.service.params import AnalysisParams  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    runs = []
    for _ in range(repeats):
        with Timer() as t:
            fn()
        runs.append(t.seconds)
    return median(runs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layer", type=int, default=2, help="the layer whose statistics are split into parts")
    args = parser.parse_args(argv)

    model = load_model(args.model, device="cpu")
    params = AnalysisParams()
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus_prefix(default_corpus(), args.batch_size * args.batches * 600, Path(tmp) / "c.txt")
        batches = [b for b, _, _ in iter_batches(str(corpus), model, params, tokens, batch_size=args.batch_size)]
        batches = batches[: args.batches]
        windows = sum(len(b.windows) for b in batches)
        print(
            f"# {machine()}; {torch.get_num_threads()} threads; model {args.model}; "
            f"{len(batches)} batches of {args.batch_size}; seq_len 128; medians of {args.repeats}"
        )

        runs = forward_passes(model, batches, params, tokens, args.repeats)
        base = median(runs["bare forward"])
        print(f"\n{'pass':<18} {'ms/batch':>9} {'ms/window':>10} {'× bare':>7}")
        for name, seconds in runs.items():
            m = median(seconds)
            print(f"{name:<18} {m / len(batches) * 1000:>9.1f} {m / windows * 1000:>10.2f} {m / base:>7.2f}")

        # one layer's statistics, part by part, on the first batch
        b = batches[0]
        acts = forward(model, b)
        with torch.inference_mode():
            feats = features.window_features(b.input_ids, b.attention_mask, tokens, workspace=features.Workspace())
            z = pair_selection.head_vectors(acts[act_name("z", args.layer)], model.n_heads)
            attn = acts[act_name("pattern", args.layer)]
            sim = pair_selection.masked_similarity(z, feats)
            parts = {
                "similarity matrix": lambda: pair_selection.masked_similarity(z, feats),
                "top-k selection": lambda: pair_selection.select_pairs(sim, feats, params.select),
                "attention sums": lambda: stats.attention_sums(attn, feats, work=feats.workspace),
                "  of which entropy": lambda: stats._entropy_rows(attn, feats.workspace),
                "head_statistics": lambda: stats.head_statistics(
                    z, attn, feats, select=params.select, gate=params.gate, seq_len=params.seq_len
                ),
            }
            print(f"\nlayer {args.layer}, one batch of {len(b.windows)}: ms")
            for name, fn in parts.items():
                print(f"  {name:<20} {timed(fn, args.repeats) * 1000:>7.1f}")

        tokenise = timed(
            lambda: sum(1 for _ in iter_batches(str(corpus), model, params, tokens, batch_size=args.batch_size)),
            args.repeats,
        )
        all_windows = sum(
            len(b.windows) for b, _, _ in iter_batches(str(corpus), model, params, tokens, batch_size=args.batch_size)
        )
        print(f"\ntokenisation and windowing: {tokenise / all_windows * 1000:.2f} ms/window")

        one = Path(tmp) / "one.txt"
        one.write_text("A single short document. It fits in one window.\n", encoding="utf-8")
        summary = survey_corpus(str(one))
        fixed = []
        for k in range(args.repeats):
            store = Store(Path(tmp) / f"fixed-{k}.duckdb")
            store.ensure_schema()  # set-up of a new database, not part of a run
            with Timer() as t:
                analyze_corpus(str(one), store=store, model=model, params=params, corpus=summary, batch_size=1)
            fixed.append(t.seconds)
        print(f"a one-window run into a fresh database (the per-run fixed cost): {median(fixed):.2f} s")


if __name__ == "__main__":
    main()
