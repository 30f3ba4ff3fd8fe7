"""The cost of streaming effects (SPEC §10) against the full forward passes they replace.

    python benchmarks/streaming.py [--models smollm2] [--windows 2] [--seq-len 256] [--sink 4] [--recent 64]
                                   [--repeats 2] [--clock wall|cpu] [--threads N]

Per model, on windows of the development corpus (or the shipped excerpt), interleaved in one
process: one forward pass with the objective (for a decoder the LM head's loss), and every KV head
streaming in turn (``streaming.streaming_effects``: the intact pass recorded once, each layer's KV
heads restarted from its recorded input in one stacked pass, the intact pass's attention read for
the predictor), against layers × KV heads full forward passes with the objective, what measuring
each head by a pass of its own would cost. The restarts replay Σ_l (L − l) / L of those passes' layers
(0.52× for 30 layers), plus the intact pass; the stacked copies of a layer run as one batch, which a
CPU runs faster than as many passes of one window (SmolLM2, 1 window × 256 tokens, CPU seconds on
2 shared cores: 173 s against 90 × 5.8 s, 0.33×). Medians of ``--repeats`` with their range.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import machine, median  # noqa: E402
from benchmarks.effects import CLOCKS, show, timed, windows  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.measures import effects as fx  # noqa: E402
from headatlas.service.measures import streaming as st  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--recent", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's choice)")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{machine()}, {torch.get_num_threads()} threads; {args.windows} windows × {args.seq_len} tokens; "
        f"S = {args.sink}, W = {args.recent}; {args.clock} seconds"
    )
    print("| model | what | seconds (median, range) | against | ratio |")
    print("|---|---|---|---|---|")
    for spec in args.models.split(","):
        model = load_model(spec, device="cpu")
        ids, mask = windows(model, args.windows, args.seq_len)
        objective = fx.objective_of(model)
        passes = model.n_layers * model.n_kv_heads

        def forward_objective(model=model, ids=ids, mask=mask, objective=objective) -> None:
            with torch.no_grad():
                final = fx._run_model(model, ids, mask)
                objective.per_window(final, ids, mask, final)

        def streaming(model=model, ids=ids, mask=mask) -> None:
            st.streaming_effects(model, ids, mask, sink=args.sink, recent=args.recent)

        forward_objective()  # warm
        full, stream = [], []
        for _ in range(args.repeats):
            full += timed(forward_objective, 3, clock)
            stream += timed(streaming, 1, clock)
        ratio = median(stream) / (passes * median(full))
        floor = sum(model.n_layers - layer for layer in range(model.n_layers)) / model.n_layers**2
        print(f"| {model.name} | one forward pass with the objective ({objective.name}) | {show(full)} | | |")
        print(
            f"| {model.name} | every KV head streaming ({passes}: {model.n_layers} layers × {model.n_kv_heads}) | "
            f"{show(stream)} | {passes} forward passes with the objective, {passes * median(full):.2f} s | "
            f"**{ratio:.2f}×** (layers replayed: {floor:.2f}× + the intact pass) |"
        )


if __name__ == "__main__":
    main()
