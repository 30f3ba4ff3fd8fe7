"""What a finished run's derivation (``reports.stored.derive``) costs in CPU, the way it is and the
way it was before its halves shared one statement and its heads and layers came from the
``*_reps`` rows it reads for their intervals.

    python benchmarks/derive_cpu.py [--repeats 9]

Analyses the shipped excerpt's first three documents with ``random:tiny`` (``--seq-len 32
--sentences punct --replicates window``, 16 replicate groups), then derives its results
``--repeats`` times each way, alternated in this one process, and prints the median and range of
each way's process CPU (``time.process_time``). The old way is the same code with
``halves.subsets_head_rows`` computing each half alone (``halves.head_rows``, two statements a half)
and the shared reads of heads and layers off (``query_support.shared_cache``), as
``tests/test_role_stability.py`` compares their results.
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


if __name__ == "__main__":
    main()
