"""What keeping the heads' top examples costs a run: CPU seconds of the batch path (the forward
pass with every measure, ``analyze_batch``) and of the storing transaction's rows
(``batch_tables`` + ``example_tables``), with ``--examples 0`` and with N, alternated, on the
shipped excerpt; and the payload's bytes per batch.

    python benchmarks/examples_overhead.py [--model default] [--examples 5] [--repeats 3]

Process CPU time (``time.process_time``), so other processes on the machine count less than in
wall time; the minimum over the repeats of each setting is reported.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--examples", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args(argv)

    import torch

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.corpus import demo_corpus_path
    from headatlas.service.engine.model import load_model
    from headatlas.service.engine.run_plan import iter_batches
    from headatlas.service.engine.windows import TokenClasses
    from headatlas.service.storage.batch_rows import batch_tables
    from headatlas.service.storage.example_rows import example_tables

    torch.set_num_threads(1)  # one core: the figures of a loaded machine, comparable between settings
    model = load_model(args.model, device="cpu")
    tokens = TokenClasses.for_model(model)
    settings = {k: build_params(examples=k) for k in (0, args.examples)}
    batches = [
        (b, docs)
        for b, docs, _ in iter_batches(str(demo_corpus_path()), model, settings[0], tokens, batch_size=args.batch_size)
    ]
    windows = sum(len(b.windows) for b, _ in batches)
    best: dict[int, dict[str, float]] = {k: {"batch": float("inf"), "rows": float("inf")} for k in settings}
    payload: dict[int, int] = {}
    for _ in range(args.repeats):
        for k, params in settings.items():
            start = time.process_time()
            results = [analyze_batch(model, b, params, tokens, documents=docs) for b, docs in batches]
            batch_s = time.process_time() - start
            items = list(enumerate(results))
            start = time.process_time()
            batch_tables(1, items)
            example_tables(1, items)
            rows_s = time.process_time() - start
            best[k]["batch"] = min(best[k]["batch"], batch_s)
            best[k]["rows"] = min(best[k]["rows"], rows_s)
            payload[k] = sum(len(r.to_bytes()) for r in results) // len(results)
    print(f"{model.name}: {windows} windows of the shipped excerpt in {len(batches)} batches, one CPU thread")
    for k in settings:
        print(
            f"  examples={k}: batches {best[k]['batch']:.2f} s CPU, rows {best[k]['rows']:.3f} s CPU, "
            f"payload {payload[k] / 1024:.1f} KiB a batch"
        )
    base, more = best[0], best[args.examples]
    print(
        f"  overhead: batches {more['batch'] - base['batch']:+.2f} s ({(more['batch'] / base['batch'] - 1) * 100:+.1f} %), "
        f"rows {more['rows'] - base['rows']:+.3f} s, payload {(payload[args.examples] - payload[0]) / 1024:+.1f} KiB a batch"
    )


if __name__ == "__main__":
    main()
