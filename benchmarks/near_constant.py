"""Heads whose top similarities float32 cannot rank (near-constant z), before and after they are
ranked again at float64 (service/engine/pair_selection.py, ``rerank_unresolved``).

    python benchmarks/near_constant.py [--model smollm2] [--corpus service/data/wiki_excerpt.txt]
                                       [--documents 4] [--seq-len 256]

Analyses the first documents of the corpus twice into temporary databases: with float32 ranking
only (the rule before: the re-ranking switched off) and as the engine does now. Printed: how many
(window, head) rankings were unresolved, and the heads whose mean_distance, repetition_words or
within_sentence changed, with both values.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--corpus", default="service/data/wiki_excerpt.txt")
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)

    import headatlas
    from headatlas.service.engine import pair_selection

    folder = Path(tempfile.mkdtemp(prefix="near-constant-"))
    corpus = folder / "corpus.txt"
    text = Path(args.corpus).read_text(encoding="utf-8")
    corpus.write_text("\n\n".join(text.split("\n\n")[: args.documents]), encoding="utf-8")
    unresolved = [0, 0]  # rows re-ranked, rows seen
    original = pair_selection.unresolved_rows

    def counting(z, values, counts, n_pairs):
        rows = original(z, values, counts, n_pairs)
        unresolved[0] += int(rows.sum())
        unresolved[1] += rows.numel()
        return rows

    metrics = ("mean_distance", "repetition_words", "within_sentence")
    results = {}
    for label, enabled in (("float32", False), ("reranked", True)):
        pair_selection.unresolved_rows = counting if enabled else (lambda z, v, c, n: original(z, v, c, n) & False)
        run = headatlas.analyze(
            corpus, db=folder / f"{label}.duckdb", model=args.model, seq_len=args.seq_len, progress=False
        )
        heads = run.heads().to_pylist()
        results[label] = {(h["layer"], h["head"]): h for h in heads}
    pair_selection.unresolved_rows = original
    print(f"# {args.model}, {args.documents} documents of {args.corpus}, seq_len {args.seq_len}")
    print(f"unresolved (window, head) rankings: {unresolved[0]:,} of {unresolved[1]:,}")
    changed = 0
    for key, before in sorted(results["float32"].items()):
        after = results["reranked"][key]
        moved = [m for m in metrics if before.get(m) != after.get(m)]
        if moved:
            changed += 1
            text = ", ".join(f"{m} {before[m]:.4g} -> {after[m]:.4g}" for m in moved)
            print(f"head {key[0]}.{key[1]}: {text}")
    print(f"heads changed: {changed} of {len(results['float32'])}")


if __name__ == "__main__":
    main()
