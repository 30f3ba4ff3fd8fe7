"""What --sentences segmenter costs next to tokenisation, per window.

    python benchmarks/sentences.py [--corpus PATH] [--repeats 7]

On the shipped excerpt by default. Prints, in ms per 128-token window (medians, interleaved):
the tokenizer alone as punct calls it, the tokenizer with character offsets, the segmenter
alone (sentence spans of each document), and the whole windowing (documents → windows) under
punct and under the segmenter; then the segmenter's share of the windowing. Needs no model
weights: only the default tokenizer.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Timer, machine, median  # noqa: E402
from headatlas.service.engine.corpus import demo_corpus_path, iter_documents  # noqa: E402
from headatlas.service.engine.sentences import sentence_starts  # noqa: E402
from headatlas.service.engine.windows import TokenClasses, document_windows  # noqa: E402
from headatlas.service.params import AnalysisParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(demo_corpus_path()))
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from headatlas.service.engine.model import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    tokens = TokenClasses.from_tokenizer(tokenizer)
    docs = list(iter_documents(args.corpus))
    punct, segmenter = AnalysisParams(sentences="punct"), AnalysisParams(sentences="segmenter")
    n_windows = sum(len(document_windows(d, tokenizer, tokens, "k", punct)) for d in docs)

    steps = {
        "tokenizer (punct's call)": lambda: [
            tokenizer(d.text, add_special_tokens=False, truncation=False) for d in docs
        ],
        "tokenizer with offsets": lambda: [
            tokenizer(d.text, add_special_tokens=False, truncation=False, return_offsets_mapping=True) for d in docs
        ],
        "segmenter alone": lambda: [sentence_starts(d.text) for d in docs],
        "windows, punct": lambda: [document_windows(d, tokenizer, tokens, "k", punct) for d in docs],
        "windows, segmenter": lambda: [document_windows(d, tokenizer, tokens, "k", segmenter) for d in docs],
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for fn in steps.values():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in steps.items():  # interleaved, so drift hits every step alike
            with Timer() as t:
                fn()
            times[name].append(t.seconds)
    per_window = {name: median(v) / n_windows * 1000 for name, v in times.items()}

    print(
        f"{machine()}\n{len(docs)} documents, {sum(len(d.text) for d in docs):,} characters, "
        f"{n_windows} windows of {punct.seq_len} tokens; medians of {args.repeats}"
    )
    base = per_window["tokenizer (punct's call)"]
    for name, ms in per_window.items():
        print(f"  {name:<26} {ms:7.3f} ms/window  ({ms / base:.2f}× tokenizer)")
    extra = per_window["windows, segmenter"] - per_window["windows, punct"]
    print(
        f"segmenter windows cost {extra:+.3f} ms/window over punct "
        f"({extra / per_window['windows, punct'] * 100:+.0f}% of punct's windowing)"
    )


if __name__ == "__main__":
    main()
