"""Cost of the corpus-averaged similarity matrices (SPEC §5c) over the full analysis, and their
share of a batch's payload.

    python benchmarks/csm_overhead.py [--model default] [--windows 128] [--rounds 7] [--csm-bin 8]

One process loads the model and cuts the same windows once; each round times ``analyze_batch``
on every batch with the matrices (``--csm-bin``) and without them (``--csm-bin 0``), back to
back, the order alternating, so that drifts in machine load hit both sides. The figure is the
median over (round, batch) of (with / without). Target: ≤ 1.05. On a busy machine that ratio
scatters widely; the script also clocks the matrices' own function inside the analyses (a share
of the same calls' time, which load scales on both sides) and reports what it implies. The payload row is the compressed bytes
of one full batch (``BatchResult.to_bytes``) with and without the matrices.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import corpus_prefix, default_corpus, machine, median  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--windows", type=int, default=128, help="about this many windows of the corpus")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--csm-bin", type=int, default=8)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.params import AnalysisParams

    model = load_model(args.model, device="cpu")
    with_csm = AnalysisParams(sentences="punct", csm_bin=args.csm_bin)  # punct: no segmenter cost in either
    without = replace(with_csm, csm_bin=0)
    tokens = TokenClasses.from_tokenizer(model.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = corpus_prefix(default_corpus(), args.windows * 620, Path(tmp) / "corpus.txt")
        batches = [b for b, _, _ in iter_batches(str(corpus), model, with_csm, tokens, batch_size=args.batch_size)]
    windows = sum(len(b.windows) for b in batches)

    def timed(params, batch) -> float:
        start = time.perf_counter()
        analyze_batch(model, batch, params, tokens)
        return time.perf_counter() - start

    for b in batches[:2]:  # warm-up: buffers, caches
        timed(with_csm, b), timed(without, b)
    ratios, on_s, off_s = [], [], []
    for k in range(args.rounds):
        on_round = off_round = 0.0
        for n, b in enumerate(batches):
            # the same batch back to back, the order alternating: load drifts hit both sides
            if (k + n) % 2 == 0:
                on, off = timed(with_csm, b), timed(without, b)
            else:
                off, on = timed(without, b), timed(with_csm, b)
            ratios.append(on / off)
            on_round, off_round = on_round + on, off_round + off
        on_s.append(on_round)
        off_s.append(off_round)
        print(
            f"round {k + 1}: with {on_round / windows * 1000:.1f} ms/window, without "
            f"{off_round / windows * 1000:.1f} ms/window",
            flush=True,
        )
    # the matrices' own time inside the same analyses: a share that machine load scales on both sides
    from headatlas.service.engine import averaged_csm

    inner, outer = [0.0], 0.0
    original = averaged_csm.averaged_csm_sums

    def clocked(*a, **kw):
        start = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            inner[0] += time.perf_counter() - start

    averaged_csm.averaged_csm_sums = clocked
    try:
        for _ in range(2):
            for b in batches:
                outer += timed(with_csm, b)
    finally:
        averaged_csm.averaged_csm_sums = original
    share = inner[0] / outer
    full = [b for b in batches if len(b.windows) == args.batch_size] or batches
    payload_on = len(analyze_batch(model, full[0], with_csm, tokens).to_bytes())
    payload_off = len(analyze_batch(model, full[0], without, tokens).to_bytes())
    ratios.sort()
    print(
        f"# {args.model}, {windows} windows, batch {args.batch_size}, seq_len {with_csm.seq_len}, "
        f"{args.threads} threads, {args.rounds} rounds × {len(batches)} batches; {machine()}"
    )
    print(
        f"analysis per window: with matrices {median(on_s) / windows * 1000:.1f} ms, "
        f"without {median(off_s) / windows * 1000:.1f} ms"
    )
    print(
        f"overhead of the averaged matrices (--csm-bin {args.csm_bin}): {median(ratios):.3f}x "
        f"(range {ratios[0]:.3f}-{ratios[-1]:.3f}; target <= 1.05)"
    )
    print(
        f"the matrices' own time: {share:.1%} of the analysis with them, i.e. {1 / (1 - share):.3f}x the "
        "analysis without them"
    )
    print(
        f"payload of one batch of {len(full[0].windows)} windows: {payload_on:,} bytes with the matrices, "
        f"{payload_off:,} without (+{payload_on - payload_off:,} bytes)"
    )


if __name__ == "__main__":
    main()
