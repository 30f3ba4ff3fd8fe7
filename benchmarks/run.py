"""The benchmark suite: one command, one table of figures and ratios measured in one run.

    python benchmarks/run.py            # everything (about 15–30 minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # smaller sizes, for a smoke test

Rows: the pipeline around the model stage by stage (benchmarks/pipeline.py); bare forward vs full analysis (ratio) and the naive per-window/per-head baseline
(speed-up) for the default model and random:bert-base; the same ratio for a decoder (SmolLM2,
with its first and cached load and peak memory); embedded vs queue windows/s (ratio,
needs Redis); ingest rows/s and query latency on a 20,000-window, 144-head synthetic run; the web
app's page times on a 20,000-window run and a head's example window;
peak memory for 2,000 vs 20,000 windows. GPU rows run when CUDA is present, else they say
"not measured".
"""

from __future__ import annotations

import argparse
import io
import sys
from contextlib import redirect_stdout
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import decoder, forward_vs_full, long_windows, memory, pipeline, query_speed, web_pages  # noqa: E402
from benchmarks.common import machine  # noqa: E402


def section(title: str, fn, *args) -> str:
    print(f"\n## {title}", flush=True)
    buf = io.StringIO()
    with redirect_stdout(buf):
        try:
            fn(*args)
        except SystemExit as exc:  # a part that cannot run here says why
            print(f"not measured: {exc}")
    print(buf.getvalue(), end="", flush=True)
    return buf.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--gpu-only", action="store_true", help="only the GPU rows (make gpu-check)")
    args = parser.parse_args(argv)
    import torch

    print(f"# headatlas benchmarks — {machine()}")
    windows = "96" if args.quick else "512"
    if not args.gpu_only:
        section(
            "Bare forward vs full analysis, CPU (target ratio ≤ 1.3; naive speed-up ≥ 1.8×)",
            forward_vs_full.main,
            ["--windows", windows, "--repeats", "2" if args.quick else "3"],
        )
        section(
            "Decoder (SmolLM2-135M), CPU: full analysis / bare forward (target ≤ 1.3), first and cached load, "
            "peak memory",
            decoder.main,
            ["--windows", "16" if args.quick else "32", "--repeats", "2" if args.quick else "3"],
        )
        section(
            "Long windows, SmolLM2's shape (random weights), CPU: time and peak memory per window, with the "
            "similarity matrix in row chunks and whole",
            long_windows.main,
            ["--lengths", "128,512" if args.quick else "128,512,2048,4096"]
            + ["--whole", "512" if args.quick else "2048,4096"]
            + (["--layers", "2"] if args.quick else []),
        )
    if torch.cuda.is_available():
        section(
            "Bare forward vs full analysis, GPU (target ratio ≤ 1.15)",
            forward_vs_full.main,
            ["--windows", "4096", "--device", "cuda", "--batch-size", "256", "--no-naive"],
        )
        section(
            "GPU, bfloat16 autocast",
            forward_vs_full.main,
            ["--windows", "4096", "--device", "cuda", "--batch-size", "256", "--dtype", "bfloat16", "--no-naive"],
        )
        section(
            "Decoder (SmolLM2-135M's shape, random weights: the same work per window), GPU: full / bare",
            forward_vs_full.main,
            [
                "--models",
                "random:smollm2",
                "--windows",
                "4096",
                "--device",
                "cuda",
                "--batch-size",
                "128",
                "--no-naive",
            ],
        )
    else:
        print("\n## GPU rows\nnot measured: no CUDA device on this machine")
    if args.gpu_only:
        return
    try:
        from benchmarks import queue_throughput as queue_bench
    except ImportError:
        queue_bench = None
    if queue_bench is not None:
        section(
            "Embedded vs queue, 1 worker (target ≥ 0.9×)", queue_bench.main, ["--copies", "2" if args.quick else "8"]
        )
    section(
        "The pipeline around the model, windows/s: preparation in 1 and N processes (target ≥ 2,500 with the "
        "segmenter on 2 cores), the queue message per batch, storing (targets ≥ 10,000 MiniLM-shaped, ≥ 3,000 "
        "SmolLM2-shaped into a file; a lake ≥ 0.8× that), whole random:tiny runs",
        pipeline.main,
        ["--quick"] if args.quick else ["--max-chars", "1500000"],
    )
    section(
        "Ingest and query latency, 20,000 windows × 144 heads (target < 0.5 s)",
        query_speed.main,
        ["--windows", "2000" if args.quick else "20000"],
    )
    section(
        "headatlas serve: each page rendered on the server, 20,000 windows (target < 0.3 s); a head's example "
        "window, MiniLM on CPU (target < 3 s); start",
        web_pages.main,
        ["--windows", "2000" if args.quick else "20000", "--repeats", "3"],
    )
    section(
        "Peak memory, 2,000 vs 20,000 windows (must be flat)",
        memory.main,
        ["--small", "300" if args.quick else "2000", "--large", "1500" if args.quick else "20000"],
    )


if __name__ == "__main__":
    main()
