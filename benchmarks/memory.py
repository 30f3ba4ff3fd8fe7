"""Peak memory of `headatlas analyze` for 2,000 vs 20,000 windows: it must be flat.

    python benchmarks/memory.py [--small 2000] [--large 20000] [--model random:tiny]

Each size runs in its own process (peak RSS from getrusage). The corpus is the development
corpus (or the shipped excerpt) repeated with a distinct first line per copy, so that every
document is new. The model is small on purpose: what is measured is whether memory grows with
the corpus (streaming windows, bounded queues, flushes), not the model's own footprint.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Timer, default_corpus  # noqa: E402

CHILD = """
import json, resource, sys, time
sys.argv = ["headatlas"] + json.loads(sys.argv[1])
from headatlas.cli.main import main
start = time.perf_counter()
try:
    main()
except SystemExit as exc:
    if exc.code:
        raise
print(json.dumps({"peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": time.perf_counter() - start}))
"""


def build_corpus(windows: int, out: Path) -> Path:
    docs = [d.strip() for d in default_corpus().read_text(encoding="utf-8").split("\n\n") if d.strip()]
    target_chars = windows * 595  # about 595 characters of Wikipedia prose per 126 word pieces (measured)
    with out.open("w", encoding="utf-8") as f:
        size, copy = 0, 0
        while size < target_chars:
            for doc in docs:
                text = f"Copy {copy}.\n{doc}" if copy else doc
                f.write(text + "\n\n")
                size += len(text)
                if size >= target_chars:
                    break
            copy += 1
    return out


def measure(corpus: Path, db: Path, model: str) -> dict:
    args = ["analyze", str(corpus), "--db", str(db), "--model", model, "--quiet"]
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )
    if done.returncode:
        raise SystemExit(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    result["windows"] = con.execute("SELECT count(*) FROM run_windows").fetchone()[0]
    con.close()
    return result


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=2000)
    parser.add_argument("--large", type=int, default=20000)
    parser.add_argument("--model", default="random:tiny")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        print(f"# peak RSS of `headatlas analyze --model {args.model}`, one process per size")
        print(f"{'windows':>8} {'peak MB':>8} {'seconds':>8}")
        for size in (args.small, args.large):
            corpus = build_corpus(size, Path(tmp) / f"c{size}.txt")
            with Timer():
                r = measure(corpus, Path(tmp) / f"m{size}.duckdb", args.model)
            rows.append(r)
            print(f"{r['windows']:>8,} {r['peak_mb']:>8.0f} {r['seconds']:>8.1f}", flush=True)
        print(f"ratio of peaks (large / small): {rows[1]['peak_mb'] / rows[0]['peak_mb']:.2f}  (flat = about 1)")
    return rows


if __name__ == "__main__":
    main()
