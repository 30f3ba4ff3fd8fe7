"""Attribution cost: ms per window for the batched backward passes against a plain
one-output-at-a-time loop, and the ratio to a bare forward pass; forward-only mixing for
comparison.

    python benchmarks/attribution.py --seq-len 32 --windows 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from headatlas.service.engine.corpus import demo_corpus_path, iter_documents  # noqa: E402
from headatlas.service.engine.features import window_features  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.engine.windows import TokenClasses, collate, document_windows  # noqa: E402
from headatlas.service.measures.attribution import gradient_norms, trace  # noqa: E402
from headatlas.service.measures.mixing import mixing_sums  # noqa: E402
from headatlas.service.params import AnalysisParams  # noqa: E402


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-loop", action="store_true", help="skip the unbatched baseline (slow)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    params = AnalysisParams(seq_len=args.seq_len)
    windows = []
    for doc in iter_documents(str(demo_corpus_path())):
        windows += [
            w
            for w in document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params)
            if len(w.input_ids) == args.seq_len
        ]
        if len(windows) >= args.windows:
            break
    batch = collate(windows[: args.windows], tokens.pad_id)
    ids, mask = batch.input_ids, batch.attention_mask
    n = len(batch.windows)
    fwd = timed(lambda: trace(model, ids, mask), 5) / n
    rows = lambda: None  # noqa: E731
    print(f"model {model.name}, {n} windows × {args.seq_len} tokens, {args.threads} threads, chunk {args.chunk}")
    print(f"forward                 {1000 * fwd:10.1f} ms/window")
    feats = window_features(ids, mask, tokens)
    for method in ("rollout", "norm", "alti"):
        t = (
            timed(
                lambda method=method: mixing_sums(
                    model,
                    ids,
                    mask,
                    feats,
                    methods=(method,),
                    attribution=False,
                    seq_len=args.seq_len,
                    chunk_size=args.chunk,
                ),
                3,
            )
            / n
        )
        print(f"mixing {method:<16} {1000 * t:10.1f} ms/window  ({t / fwd:6.1f}× forward, incl. its own forward)")
    batched = timed(lambda: gradient_norms(model, ids, mask, chunk_size=args.chunk, batched=True), 1) / n
    print(f"attribution batched     {1000 * batched:10.1f} ms/window  ({batched / fwd:8.0f}× forward)")
    if not args.skip_loop:
        loop = timed(lambda: gradient_norms(model, ids, mask, batched=False), 1) / n
        print(
            f"attribution loop        {1000 * loop:10.1f} ms/window  ({loop / fwd:8.0f}× forward); "
            f"batched is {loop / batched:.2f}× faster"
        )
    outputs = model.n_layers * (model.n_heads + 1) * args.seq_len
    print(f"({outputs} backward passes per window: layers × (heads + layer row) × tokens)")
    del rows


if __name__ == "__main__":
    main()
