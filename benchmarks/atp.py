"""Attribution patching (``--effects atp``, SPEC §9) against the exact mean ablation it estimates.

    python benchmarks/atp.py [--model smollm2] [--windows 6] [--seq-len 128] [--reference 16] [--top 10]
                             [--repeats 1] [--atp-repeats 3] [--clock wall|cpu] [--threads N]

On ``--windows`` windows of the shipped excerpt (``--seq-len`` tokens, spread over its six documents
as ``headatlas effects CORPUS`` takes them), every head's mean-ablation effect measured exactly (``head_effects``,
kind ``mean``: each head's z set to its reference mean, layers replayed from the recorded input)
and estimated by AtP (kind ``atp``: one forward and one backward pass), both against the same
reference means (the mean z over the excerpt's first ``--reference`` windows, as a run's), each head's
effect the mean over the windows, as a run stores it. Printed:

- agreement: Spearman's ρ across all heads, and the top-``--top`` recall (of the heads with the
  largest exact |effect|, the share among those with the largest |AtP|); ρ and the recall of each
  window on its own too (median and range), since a run may hold few effect windows;
- cost: AtP's seconds against the exact ablation's (medians of ``--repeats`` exact ablations and of
  ``--atp-repeats`` AtP passes beside each, interleaved), and AtP against one forward pass with the
  objective.

``--clock cpu`` with ``--threads 1`` measures CPU seconds of the work, as benchmarks/effects.py
does: on a shared machine, the load does not enter the ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import machine, median  # noqa: E402
from headatlas.service.engine.corpus import demo_corpus_path  # noqa: E402
from headatlas.service.engine.model import load_model  # noqa: E402
from headatlas.service.measures import effects as fx  # noqa: E402
from headatlas.service.measures.atp_check import compare  # noqa: E402

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def excerpt_windows(model, seq_len: int, n: int, reference: int):
    """``n`` windows of the shipped excerpt spread over its documents (as ``headatlas effects CORPUS``
    takes them) and its first ``reference`` windows (the reference set, as a run takes it), each a
    ``(input_ids, attention_mask)`` batch."""
    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.corpus import iter_documents
    from headatlas.service.engine.run_plan import first_windows
    from headatlas.service.engine.windows import TokenClasses, collate
    from headatlas.service.operations.effect_runs import spread_windows

    corpus = str(demo_corpus_path())
    params = build_params(seq_len=seq_len)
    tokens = TokenClasses.for_model(model)
    chosen = spread_windows(iter_documents(corpus), model, params, n)
    ref = first_windows(corpus, model, params, tokens, reference)
    if len(chosen) < n:
        raise SystemExit(f"the excerpt gives {len(chosen)} windows, not {n}")
    batch, ref_batch = collate(chosen, tokens.pad_id), collate(ref, tokens.pad_id)
    return (batch.input_ids, batch.attention_mask), (ref_batch.input_ids, ref_batch.attention_mask), len(ref)


def timed(fn, clock):
    began = clock()
    out = fn()
    return out, clock() - began


def spread(values: list[float]) -> str:
    return f"{median(values):.3f} ({min(values):.3f} to {max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--reference", type=int, default=16, help="the excerpt's first N windows give the means")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1, help="exact ablations timed (minutes each on a CPU)")
    parser.add_argument("--atp-repeats", type=int, default=3, help="AtP passes timed beside each exact ablation")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model, device="cpu")
    objective = fx.objective_of(model)
    if not objective.is_loss:
        raise SystemExit(f"{model.name}'s objective is {objective.name}, not a loss: AtP needs one")
    (ids, mask), reference, n_reference = excerpt_windows(model, args.seq_len, args.windows, args.reference)
    means, positions = fx.reference_means(model, [reference])
    heads = model.n_layers * model.n_heads
    print(
        f"{machine()}, {torch.get_num_threads()} threads; {model.name} ({model.n_layers} layers × {model.n_heads} "
        f"heads = {heads}), {objective.name}; {args.windows} windows × {args.seq_len} tokens of the shipped excerpt; "
        f"reference means over {positions} positions (the excerpt's first {n_reference} windows); {args.clock} seconds"
    )

    def forward():
        with torch.no_grad():
            final = fx._run_model(model, ids, mask)
            return objective.per_window(final, ids, mask, final)

    forward()  # warm: a model's first pass pays for allocations later passes reuse
    fwd, atp_s, exact_s = [], [], []
    atp = exact = None
    for _ in range(args.repeats):  # interleaved: a change of load hits both alike
        fwd.append(timed(forward, clock)[1])
        for _ in range(args.atp_repeats):
            got, seconds = timed(lambda: fx.head_effects(model, ids, mask, kinds=("atp",), means=means), clock)
            atp, _ = got.effect["atp"], atp_s.append(seconds)
        got, seconds = timed(lambda: fx.head_effects(model, ids, mask, kinds=("mean",), means=means), clock)
        exact, _ = got.effect["mean"], exact_s.append(seconds)
    assert atp is not None and exact is not None
    check = compare(atp.mean(dim=0).numpy(), exact.mean(dim=0).numpy(), args.top)
    per_window = [compare(atp[w].numpy(), exact[w].numpy(), args.top) for w in range(args.windows)]
    scale = float(np.abs(exact.mean(dim=0).numpy()).max())
    print()
    print("| what | value |")
    print("|---|---|")
    print(
        f"| Spearman ρ, AtP vs exact mean ablation, {heads} heads (mean over {args.windows} windows) | **{check.spearman:.3f}** |"
    )
    print(f"| top-{args.top} recall (by \\|effect\\|) | **{check.recall:.2f}** |")
    print(f"| per window: Spearman ρ, median (range) | {spread([c.spearman for c in per_window])} |")
    print(f"| per window: top-{args.top} recall, median (range) | {spread([c.recall for c in per_window])} |")
    print(f"| largest exact \\|effect\\| (nats) | {scale:.4g} |")
    print(f"| exact mean ablation of every head, {args.clock} s (median of {args.repeats}) | {median(exact_s):.2f} |")
    print(f"| AtP of every head, {args.clock} s (median of {args.repeats * args.atp_repeats}) | {median(atp_s):.3f} |")
    print(f"| one forward pass with the objective, {args.clock} s | {median(fwd):.3f} |")
    print(
        f"| **cost ratio AtP / exact** | **{median(atp_s) / median(exact_s):.4f}** ({median(exact_s) / median(atp_s):.0f}× faster) |"
    )
    print(f"| AtP / one forward pass | {median(atp_s) / median(fwd):.2f}× |")
    print()
    print(f"AtP's top {args.top}, layer.head: exact effect (AtP), nats")
    for layer, head, estimate, value in check.top:
        print(f"  {layer}.{head}: {value:+.4f} ({estimate:+.4f})")


if __name__ == "__main__":
    main()
