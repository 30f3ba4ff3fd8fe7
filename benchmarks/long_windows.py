"""Long windows: time and peak memory of one window's full analysis at 128 … 8,192 tokens, for
SmolLM2-135M's shape (random weights: the same work and memory per window as the real model).

    python benchmarks/long_windows.py [--lengths 128,512,2048,4096,8192] [--layers 30] [--whole 2048,4096]

Each length runs in a fresh child process (so each peak is its own): the model is built, one
128-token window warms it up, then one window of n tokens of the development corpus (or the
shipped excerpt) is analysed with the run's defaults (top:0.02, batch of one), ``--repeats``
times (the median is shown: wall and CPU seconds). Peak memory = the child's peak resident set size, and the part of it
above the resident size after the warm-up (the window's own). ``--whole N,…`` also measures
those lengths with the similarity matrix and the attention taken whole (no row chunks, eager
attention), as before chunking. ``--layers L``
keeps the first L of the 30 blocks (time scales with the layers; the peak does not, as the
statistics of one layer are done before the next runs): for a loaded machine. The planned batch
(``--batch-size auto`` on this machine's available memory) is shown beside.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "random:smollm2"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _long_document(min_tokens: int, tokenizer) -> str:
    """Text of at least ``min_tokens`` tokens: the corpus's documents joined in order."""
    from benchmarks.long_range import _corpus_default

    text, parts = "", _corpus_default().read_text(encoding="utf-8").split("\n\n")
    for part in parts:
        text += part.strip() + " "
        if len(text) > 6 * min_tokens and len(tokenizer(text)["input_ids"]) >= min_tokens:
            return text
    return text


def child(n: int, layers: int, repeats: int, whole: bool) -> dict:
    import dataclasses

    import torch

    from headatlas.service.analysis_options import build_params
    from headatlas.service.engine import pair_selection
    from headatlas.service.engine.analysis import analyze_batch
    from headatlas.service.engine.corpus import Document, document_id
    from headatlas.service.engine.model import auto_batch_size, load_model
    from headatlas.service.engine.row_attention import block_rows, uses_row_attention
    from headatlas.service.engine.windows import TokenClasses, collate, document_windows

    if whole:
        from headatlas.service.engine import row_attention

        pair_selection.SIM_CHUNK_ELEMENTS = 1 << 62
        row_attention.ATTENTION_ROW_ELEMENTS = 1 << 62
    model = load_model(MODEL, device="cpu")
    if layers < model.n_layers:
        blocks = model.model.layers
        model.model.layers = torch.nn.ModuleList(list(blocks)[:layers])
        model.model.config.num_hidden_layers = layers
        model = dataclasses.replace(model, n_layers=layers)
    tokens = TokenClasses.for_model(model)
    text = _long_document(n, model.tokenizer)
    doc = Document(doc_id=document_id(text), source="bench", index=0, line=1, text=text)

    def window(seq_len: int):
        params = build_params(seq_len=seq_len, windowing="first", sentences="punct")
        return params, collate(
            document_windows(doc, model.tokenizer, tokens, model.tokenizer_key, params), tokens.pad_id
        )

    warm_params, warm = window(128)
    analyze_batch(model, warm, warm_params, tokens)
    base = _rss()
    params, batch = window(n)
    assert batch.input_ids.shape == (1, n), batch.input_ids.shape
    times, cpu = [], []
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.process_time()
        analyze_batch(model, batch, params, tokens)
        times.append(time.perf_counter() - began)
        cpu.append(time.process_time() - began_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "n": n,
        "seconds": statistics.median(times),
        "cpu_seconds": statistics.median(cpu),
        "peak": peak,
        "window_peak": peak - base,
        "auto_batch": auto_batch_size(model, n),
        "rows": pair_selection.similarity_chunk_rows(1, model.n_heads, n),
        "attention_rows": block_rows(1, model.n_heads, n) if uses_row_attention(model, model.n_heads, n) else n,
        "layers": layers,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,512,2048,4096,8192")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--whole", default="", help="lengths also measured without row chunks, e.g. 2048,4096")
    parser.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-whole", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.repeats, args.child_whole)))
        return
    from benchmarks.common import machine

    whole_at = {int(x) for x in args.whole.split(",") if x.strip()}

    print(
        f"{MODEL} (SmolLM2-135M's shape: 9 heads, 3 key-value heads, 576 wide), first {args.layers} of 30 layers, "
        f"one window per forward; {machine()}"
    )
    print()
    print(
        "| tokens | s per window | CPU s per window | peak RSS (GiB) | the window's own peak (GiB) | "
        "similarity rows per chunk | attention rows per block | planned batch (auto) |"
        + (" whole matrix: CPU s | whole matrix: window's peak (GiB) |" if args.whole else "")
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.whole else ""))
    for n in (int(x) for x in args.lengths.split(",")):
        runs = []
        for whole in [False, True] if n in whole_at else [False]:
            cmd = [
                sys.executable,
                __file__,
                "--child",
                str(n),
                "--layers",
                str(args.layers),
                "--repeats",
                str(args.repeats),
            ]
            done = subprocess.run(cmd + (["--child-whole"] if whole else []), capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"{n} tokens{' (whole)' if whole else ''} failed: {done.stderr[-2000:]}")
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = runs[0]
        gib = 1 << 30
        rows = "whole" if r["rows"] >= n else str(r["rows"])
        blocks = "whole (eager)" if r["attention_rows"] >= n else str(r["attention_rows"])
        line = (
            f"| {n:,} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {r['peak'] / gib:.2f} | "
            f"{r['window_peak'] / gib:.2f} | {rows} | {blocks} | {r['auto_batch']} |"
        )
        if args.whole:
            line += f" {runs[1]['cpu_seconds']:.2f} | {runs[1]['window_peak'] / gib:.2f} |" if len(runs) > 1 else " | |"
        print(line, flush=True)


if __name__ == "__main__":
    main()
