"""Windowing one long document under the sentence segmenter: CPU seconds, and what it made.

    python benchmarks/long_document.py [--chars 1000000] [--repeats 3]

Joins the development corpus (or the shipped excerpt, repeated) into one document of ``--chars``
characters without a blank line (a book, a transcript: one document, sliced into 64 KiB pieces
as it is tokenised), and windows it with the default model's tokenizer and the default
parameters (``sentences = segmenter``), ``--repeats`` times in this process. Prints the median
process CPU, the windows, and a digest of every window's id, tokens and sentence ids: two trees
compared through ``PYTHONPATH`` must print the same digest.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import default_corpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chars", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.windows import TokenClasses, iter_document_windows
    from headatlas.service.params import AnalysisParams

    words = default_corpus().read_text(encoding="utf-8").split()
    text = " ".join(words)
    while len(text) < args.chars:
        text = f"{text} {text}"
    text = text[: args.chars].rsplit(" ", 1)[0]
    model = load_model("default", device="cpu")
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder, "one.txt")
        path.write_text(text + "\n", encoding="utf-8")
        (doc,) = list(iter_documents(str(path)))
    seconds, digest, windows = [], "", 0
    for _ in range(args.repeats):
        started = time.process_time()
        made = list(iter_document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, AnalysisParams()))
        seconds.append(time.process_time() - started)
        digest = hashlib.sha256(repr([(w.window_id, w.input_ids, w.sentence_ids) for w in made]).encode()).hexdigest()
        windows = len(made)
    print(
        f"{len(doc.text):,} characters, {windows} windows: median {statistics.median(seconds):.2f} s of CPU "
        f"(range {min(seconds):.2f}-{max(seconds):.2f}, {args.repeats} repeats); digest {digest[:16]}"
    )


if __name__ == "__main__":
    main()
