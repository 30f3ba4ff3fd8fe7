"""Peak memory of one long window, end to end, under an address-space cap: an analysis through
`headatlas analyze` (forward pass, statistics, storing) and the streaming effects of SPEC §10.

    nice -n 10 python benchmarks/long_memory.py [--model smollm2] [--seq-len 4096] [--limit-gib 6]
                                                [--what analyze,streaming] [--layers 29] [--whole]

Each measurement runs in a child process of its own whose address space is capped at
``--limit-gib`` GiB (``RLIMIT_AS``, as ``prlimit --as=N`` sets it; 0: no cap), and reports its peak
resident set size (``getrusage``) and CPU seconds, or the error that stopped it. The text is the
development corpus's first document long enough for one window of ``--seq-len`` tokens (or the
shipped excerpt's documents joined, if shorter), written as a one-document corpus:

- ``analyze``: ``headatlas analyze DOC --model M --seq-len N --windowing first --batch-size 1`` into
  a new database: one window, all layers, the run's defaults (top:0.02, the averaged similarity
  matrices in bins of 8: 512 × 512 bins a head at 4,096 tokens), stored and compacted.
- ``streaming``: the same window's streaming effects (``streaming.streaming_effects``, S = 4, W =
  64) for the KV heads of ``--layers`` (default: the last layer; each layer's restart holds what any
  other's does, a block at a time, and all 30 layers cost about 46 forward passes of the 3 stacked
  copies), the intact pass included.

``--whole`` runs the streaming measurement as before long windows took row blocks (eager attention
and the per-head mask, ``row_attention.ATTENTION_ROW_ELEMENTS`` set past any window). The ratio
shown is each peak over the cap. One window, one repeat: the figure is a peak, not a time, and
its CPU seconds are said for the record only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30

CHILD = r"""
import json, resource, sys, time
job = json.loads(sys.argv[1])
began = time.process_time()
error = None
try:
    if job["what"] == "analyze":
        sys.argv = ["headatlas"] + job["args"]
        from headatlas.cli.main import main
        try:
            main()
        except SystemExit as exc:
            if exc.code:
                raise RuntimeError(f"exit {exc.code}")
    else:
        import torch
        from headatlas.service.engine import row_attention
        from headatlas.service.engine.corpus import iter_documents
        from headatlas.service.engine.model import load_model
        from headatlas.service.engine.windows import TokenClasses, collate, document_windows
        from headatlas.service.measures.streaming import streaming_effects
        from headatlas.service.params import AnalysisParams

        if job["whole"]:
            row_attention.ATTENTION_ROW_ELEMENTS = 1 << 62
        model = load_model(job["model"], device="cpu")
        tokens = TokenClasses.for_model(model)
        doc = next(iter_documents(job["corpus"]))
        params = AnalysisParams(seq_len=job["seq_len"], windowing="first", sentences="punct")
        window = document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params)[0]
        batch = collate([window], tokens.pad_id)
        got = streaming_effects(model, batch.input_ids, batch.attention_mask, sink=4, recent=64, layers=job["layers"])
        print("effects:", [round(float(x), 5) for x in got.effect[0, job["layers"]].flatten()], file=sys.stderr)
except BaseException as exc:
    error = f"{type(exc).__name__}: {str(exc)[:200]}"
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"peak_gib": usage.ru_maxrss / (1 << 20), "cpu_s": time.process_time() - began, "error": error}))
"""


def one_document(seq_len: int, model: str, out: Path) -> Path:
    """The corpus's first document of at least ``seq_len`` tokens (by the model's tokenizer) as a
    one-document corpus at ``out``."""
    from benchmarks.common import default_corpus
    from headatlas.service.engine.model import load_model_info

    tokenizer = load_model_info(model).tokenizer
    docs = [d.strip() for d in default_corpus().read_text(encoding="utf-8").split("\n\n") if d.strip()]
    text = next((d for d in docs if len(tokenizer(d)["input_ids"]) >= seq_len), " ".join(docs))
    out.write_text(text + "\n", encoding="utf-8")
    return out


def measure(job: dict, limit_gib: float) -> dict:
    def cap() -> None:
        if limit_gib > 0:
            size = int(limit_gib * GIB)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))

    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(job)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=cap,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = [line for line in done.stdout.strip().splitlines() if line.startswith("{")]
    if not lines:  # killed before it could say (a signal, or a failure outside the job)
        return {
            "peak_gib": float("nan"),
            "cpu_s": float("nan"),
            "error": f"exit {done.returncode}: {done.stderr[-300:]}",
        }
    result = json.loads(lines[-1])
    result["stderr"] = done.stderr[-400:]
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--limit-gib", type=float, default=6.0, help="address-space cap of each child (0: none)")
    parser.add_argument("--what", default="analyze,streaming")
    parser.add_argument("--layers", default="29", help="streaming: the layers whose KV heads stream")
    parser.add_argument("--whole", action="store_true", help="streaming: eager attention and the per-head mask")
    args = parser.parse_args(argv)
    from benchmarks.common import machine

    cap = f"{args.limit_gib:g} GiB" if args.limit_gib > 0 else "none"
    print(f"{args.model}, one window of {args.seq_len:,} tokens; address-space cap {cap}; {machine()}")
    print()
    print("| what | peak RSS (GiB) | peak ÷ cap | CPU s | result |")
    print("|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = one_document(args.seq_len, args.model, Path(tmp) / "one.txt")
        for what in args.what.split(","):
            if what == "analyze":
                db = str(Path(tmp) / "long.duckdb")
                cli = ["analyze", str(corpus), "--model", args.model, "--seq-len", str(args.seq_len)]
                job = {"what": what, "args": [*cli, "--windowing", "first", "--batch-size", "1", "--db", db, "--quiet"]}
                label = f"`headatlas analyze --seq-len {args.seq_len}` (1 window, stored)"
            else:
                layers = [int(x) for x in args.layers.split(",")]
                job = {
                    "what": what,
                    "model": args.model,
                    "corpus": str(corpus),
                    "seq_len": args.seq_len,
                    "layers": layers,
                    "whole": args.whole,
                }
                how = "eager attention, per-head mask" if args.whole else "row blocks"
                label = f"streaming effects, layers {args.layers} ({how})"
            r = measure(job, args.limit_gib)
            ratio = f"{r['peak_gib'] / args.limit_gib:.2f}" if args.limit_gib > 0 else ""
            said = "ok" if r["error"] is None else "failed: " + " ".join(r["error"].split())  # one table row
            print(f"| {label} | {r['peak_gib']:.2f} | {ratio} | {r['cpu_s']:.0f} | {said} |", flush=True)


if __name__ == "__main__":
    main()
