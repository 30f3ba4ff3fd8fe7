"""The cost of causal head effects (SPEC §9) against the full forward passes they replace.

    python benchmarks/effects.py [--models default,smollm2] [--windows 4] [--seq-len 128] [--repeats 3]
                                 [--clock wall|cpu] [--threads N]

Per model, on windows of the development corpus (or the shipped excerpt), in one process and
interleaved (the machine's load hits every measurement alike): one intact forward pass of the base
model, and one that also computes the objective (for a decoder the 49,152-way LM head, which a
full forward pass needs to give the objective at all); ablating every head of every layer (zero
ablation: ``head_effects`` restarts each layer's ablations from its recorded input and stacks the
layer's heads) against layers × heads full forward passes with the objective (target ≤ 0.6×; the
ratio against bare forward passes is printed beside it); gradient importance (one forward and one
backward pass through every head's gate) against one forward pass with the objective (target
≤ 3×; only where the objective is a loss: not for MiniLM, whose objective is an embedding
drift). Medians of ``--repeats`` with their range, every ratio from one run.

``--clock cpu`` times each step in CPU seconds of this process (all its threads) instead of
wall-clock seconds: on a shared machine whose load changes within a run, the wall-clock time of a
minutes-long ablation and of a one-second forward pass measure different moments of load, while
their CPU seconds measure the work. Use it with ``--threads 1`` (a thread pool that spins while it
waits for a core adds CPU seconds that are no work).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import default_corpus, machine, median  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.measures import effects as fx  # noqa: E402


def windows(model, n: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    docs = [d.strip() for d in default_corpus().read_text(encoding="utf-8").split("\n\n") if len(d) > 800][:n]
    tokens = model.tokenizer(docs, max_length=seq_len, truncation=True, padding="max_length", return_tensors="pt")
    return tokens["input_ids"], tokens["attention_mask"]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, repeats: int, clock=time.perf_counter) -> list[float]:
    out = []
    for _ in range(repeats):
        began = clock()
        fn()
        out.append(clock() - began)
    return out


def show(values: list[float]) -> str:
    return f"{median(values):.3f} s ({min(values):.3f}–{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="default,smollm2")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--clock", choices=sorted(CLOCKS), default="wall", help="seconds of the wall or of this process's CPU"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: torch's choice)")
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{machine()}, {torch.get_num_threads()} threads; {args.windows} windows × {args.seq_len} tokens; "
        f"{args.clock} seconds"
    )
    print("| model | what | seconds (median, range) | against | ratio | target |")
    print("|---|---|---|---|---|---|")
    for spec in args.models.split(","):
        model = load_model(spec, device="cpu")
        ids, mask = windows(model, args.windows, args.seq_len)
        heads = model.n_layers * model.n_heads

        objective = fx.objective_of(model)

        def forward(model=model, ids=ids, mask=mask) -> None:
            with torch.no_grad():
                fx._run_model(model, ids, mask)

        def forward_objective(model=model, ids=ids, mask=mask, objective=objective) -> None:
            with torch.no_grad():
                final = fx._run_model(model, ids, mask)
                objective.per_window(final, ids, mask, final)

        forward()  # warm
        fwd, full, ablate, grad = [], [], [], []
        for _ in range(args.repeats):  # interleaved: the machine's load hits them all alike
            fwd += timed(forward, 3, clock)  # three samples of the short passes per repeat: their medians
            full += timed(forward_objective, 3, clock)
            ablate += timed(
                lambda model=model, ids=ids, mask=mask: fx.head_effects(model, ids, mask, kinds=("zero",)), 1, clock
            )
            if fx.objective_of(model).is_loss:
                grad += timed(
                    lambda model=model, ids=ids, mask=mask: fx.head_effects(model, ids, mask, kinds=("gradient",)),
                    1,
                    clock,
                )
        name = model.name
        print(f"| {name} | one forward pass (base model) | {show(fwd)} | | | |")
        print(f"| {name} | one forward pass with the objective ({objective.name}) | {show(full)} | | | |")
        ratio = median(ablate) / (heads * median(full))
        bare = median(ablate) / (heads * median(fwd))
        print(
            f"| {name} | zero-ablate all {heads} heads (with its intact pass) | {show(ablate)} | {heads} forward passes "
            f"with the objective, {heads * median(full):.2f} s | **{ratio:.2f}×** ({bare:.2f}× of bare passes) | ≤ 0.6 |"
        )
        if grad:
            # gradient importance alone: one forward pass (every gate at 1: the intact model) and one backward
            print(
                f"| {name} | gradient importance (one forward and one backward pass) | {show(grad)} | one forward pass with the "
                f"objective | **{median(grad) / median(full):.2f}×** ({median(grad) / median(fwd):.2f}× of a bare "
                f"pass) | ≤ 3 |"
            )
        else:
            print(
                f"| {name} | gradient importance | n/a: the objective is {fx.objective_of(model).name}, not a loss | | | |"
            )


if __name__ == "__main__":
    main()
