"""What a finished run's derivation (``reports.stored.derive``) costs in CPU, the way it is and the
way it was before its halves shared one statement and its heads and layers came from the
``*_reps`` rows it reads for their intervals.

    python benchmarks/derive_cpu.py [--repeats 9] [--repeatable 30]

Analyses the shipped excerpt's first three documents with ``random:tiny`` (``--seq-len 32
--sentences punct --replicates window``, 16 replicate groups), then derives its results
``--repeats`` times each way, alternated in this one process, and prints the median and range of
each way's process CPU (``time.process_time``). The old way is the same code with
``halves.subsets_head_rows`` computing each half alone (``halves.head_rows``, two statements a half)
and the shared reads of heads and layers off (``query_support.shared_cache``), as
``tests/test_role_stability.py`` compares their results.

``--repeatable N``: instead, executes ``SELECT * FROM head_metrics_reps`` of the run N times on
DuckDB's default threads and N times on one, and prints how many distinct results (bit for bit)
each gave and in which columns they differ: why that test runs on one thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--repeatable", type=int, default=0)
    args = parser.parse_args()

    from typer.testing import CliRunner

    from headatlas.cli.main import app
    from headatlas.service.reports import halves, query_support, stored
    from headatlas.service.storage.store import Store

    folder = Path(tempfile.mkdtemp())
    excerpt = (ROOT / "service" / "data" / "wiki_excerpt.txt").read_text(encoding="utf-8")
    corpus = folder / "three.txt"
    documents = [d.strip() for d in excerpt.split("\n\n") if d.strip()][:3]
    corpus.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    db = folder / "tiny.duckdb"
    flags = ["--model", "random:tiny", "--seq-len", "32", "--sentences", "punct", "--replicates", "window", "-q"]
    done = CliRunner().invoke(app, ["analyze", str(corpus), *flags, "--db", str(db)])
    assert done.exit_code == 0, done.output
    run = int(done.output.split()[0])

    if args.repeatable:
        repeatable(db, run, args.repeatable)
        return

    new_halves, new_cache = halves.subsets_head_rows, query_support.shared_cache

    def old_halves(conn, run_id, subsets, metrics):
        return [halves.head_rows(conn, run_id, h, metrics) for h in subsets]

    def ways(old: bool) -> None:
        halves.subsets_head_rows = old_halves if old else new_halves  # type: ignore[assignment]
        query_support.shared_cache = (lambda: None) if old else new_cache  # type: ignore[assignment]

    times: dict[str, list[float]] = {"old": [], "new": []}
    with Store(db).read() as conn:
        for way in ("old", "new"):  # a first derivation each way, not counted (imports, caches)
            ways(way == "old")
            stored.derive(conn, run)
        for _ in range(args.repeats):
            for way in ("old", "new"):
                ways(way == "old")
                start = time.process_time()
                stored.derive(conn, run)
                times[way].append(time.process_time() - start)
    ways(False)
    for way, spent in times.items():
        print(
            f"{way}: median {statistics.median(spent):.3f} s CPU (range {min(spent):.3f}-{max(spent):.3f}), {len(spent)} derivations"
        )


def repeatable(db: Path, run: int, n: int) -> None:
    import struct

    from sqlalchemy import text

    from headatlas.service.storage.store import Store

    def bits(row: tuple) -> tuple:
        return tuple(struct.pack("<d", v) if isinstance(v, float) else v for v in row)

    with Store(db).read() as conn:
        for threads in ("default", "1"):
            if threads == "1":
                conn.execute(text("SET threads = 1"))
            seen: list[list[tuple]] = []
            names: list[str] = []
            for _ in range(n):
                found = conn.execute(
                    text("SELECT * FROM head_metrics_reps WHERE run_id = :run ORDER BY layer, head, drop_rep"),
                    {"run": run},
                )
                names = list(found.keys())
                rows = [bits(tuple(r)) for r in found.all()]
                if rows not in seen:
                    seen.append(rows)
            differ = sorted(
                {c for other in seen[1:] for a, b in zip(seen[0], other) for c, x, y in zip(names, a, b) if x != y}
            )
            print(f"threads {threads}: {len(seen)} distinct results of {n}; differing in {differ}")
        conn.execute(text("RESET threads"))


if __name__ == "__main__":
    main()
