"""The toy induction series (service/training/toy.py): trained, analysed as one training series,
and its phase changes written out — the output docs/findings.md holds, and its figure.

    python benchmarks/toy_series.py [--steps 1500] [--seed 0] [--at 900,1000,…] [--out build/toy-series]
        [--doc docs/findings-output-toy.md] [--figure docs/img/toy-trend.png]

The same as, by hand:

    headatlas train-toy build/toy-series/ckpt --steps 1500 --seed 0 --at 900,1000,1100,1200,1300
    headatlas analyze build/toy-series/ckpt/corpus.txt --checkpoints build/toy-series/ckpt --name toy \
        --probe --probe-length 32 --db build/toy-series/toy.duckdb
    headatlas query phases --series toy --db build/toy-series/toy.duckdb
    headatlas plot trend --series toy --metric prev_token_score --metric induction_score \
        --metric attn_induction --linear --out docs/img/toy-trend.png --db build/toy-series/toy.duckdb

Checkpoints already trained under ``--out`` are kept (delete the folder to train again); the
series' analysis resumes like any run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]


def table(columns: list[str], rows: list[tuple]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--at", default="900,1000,1100,1200,1300", help="steps saved besides the log-spaced ones")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "toy-series")
    parser.add_argument("--doc", type=Path, default=ROOT / "docs" / "findings-output-toy.md")
    parser.add_argument("--figure", type=Path, default=ROOT / "docs" / "img" / "toy-trend.png")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from headatlas.service.operations.checkpoint_series import analyze_series
    from headatlas.service.operations.requests import AnalysisRequest
    from headatlas.service.reports import plots
    from headatlas.service.reports.series_plots import figure_trend
    from headatlas.service.reports.series_queries import PHASE_METRICS, largest_phases, phase_rows, phases, trend
    from headatlas.service.storage.store import Store
    from headatlas.service.training.toy import ToySpec, train_toy

    folder, db = args.out / "ckpt", args.out / "toy.duckdb"
    spec = ToySpec(steps=args.steps, seed=args.seed, extra=tuple(int(s) for s in args.at.split(",") if s))
    began = time.monotonic()
    reused = any(folder.glob("step-*"))
    if not reused:
        train_toy(folder, spec, progress=lambda step, loss: print(f"step {step}, loss {loss:.3f}", file=sys.stderr))
    trained = time.monotonic() - began
    request = AnalysisRequest.build(folder / "corpus.txt", db=db, name="toy", probe=True, probe_length=spec.max_copy)
    analyze_series(request, str(folder))
    analysed = time.monotonic() - began - trained
    with Store(db).checked_read() as conn:
        found = phases(conn, "toy", metrics=PHASE_METRICS)
        rises = largest_phases(found)
        columns, rows = phase_rows([p for p in found if rises.get(p.metric) is p])
        trends = {}
        for metric in ("prev_token_score", "induction_score"):
            rise = rises[metric]
            trends[metric] = trend(conn, "toy", metric=metric, layer=rise.layer, head=rise.head)
        fig = figure_trend(conn, "toy", ("prev_token_score", "induction_score", "attn_induction"), linear=True)
    plots.save(fig, args.figure)
    steps = [r[0] for r in trends["prev_token_score"][1]]
    out = [
        "## Findings: the toy induction series",
        "",
        f"{spec.layers} layers × {spec.heads} heads, attention-only (MLPs zeroed and frozen), hidden {spec.hidden}, "
        f"{spec.vocab} word tokens; {spec.steps} steps of batch {spec.batch}, seed {spec.seed}; "
        f"{len(steps)} checkpoints at steps {', '.join(map(str, steps))}; corpus: {spec.documents} documents "
        f"of r r (r = {spec.max_copy} tokens); probe L = {spec.max_copy}. Layers and heads 0-based. "
        + ("Trained earlier" if reused else f"Trained in {trained:.0f} s")
        + f", analysed in {analysed:.0f} s (wall, on 2 cores shared with other jobs).",
        "",
        "### The largest rise of each metric (its phase change)",
        "",
        table(columns, rows),
        "",
    ]
    for metric, (cols, values) in trends.items():
        rise = rises[metric]
        out += [f"### {metric} of layer {rise.layer} head {rise.head} by step", "", table(cols, values), ""]
    args.doc.write_text("\n".join(out), encoding="utf-8")
    print(args.doc.read_text(encoding="utf-8"))


if __name__ == "__main__":
    main()
