"""Do `sql`'s memory and time limits hold for values built outside DuckDB's buffer manager?

    python benchmarks/sql_limits.py [--memory-limit 1GB] [--timeout 5] [--repeats 3]

Runs the two queries that grew a process past its limit (a 400-million-element list, a 4 GB
string) and a plain long scan, each through ``run_readonly_sql`` (the path of `headatlas sql`,
`run.sql()` and the API), on an empty database; prints, per query, how it ended, the seconds until
the error came back (median and range) and the query process's peak resident memory (the highest
``ru_maxrss`` of the confined children, as whoever reaped them saw it: ``confined.last_peak_bytes``).
The bound: peak under the memory limit plus ``confined.MARGIN_BYTES`` plus what the process held
when it started; the time under the timeout plus ``confined.KILL_GRACE_S``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median  # noqa: E402
from headatlas.service.errors import StoreError  # noqa: E402
from headatlas.service.storage import confined, db  # noqa: E402
from headatlas.service.storage.readonly import run_readonly_sql  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402

QUERIES = [
    "SELECT len(range(0, 400000000))",  # a list of 400 million elements
    "SELECT length(repeat('x', 4000000000))",  # a 4 GB string
    "SELECT count(*) FROM range(100000000000)",  # a long scan that DuckDB interrupts
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-limit", default="1GB")
    parser.add_argument("--timeout", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "empty.duckdb"
        db.upgrade(Store(path).backend)
        print(
            f"memory limit {args.memory_limit}, timeout {args.timeout:g} s, margin "
            f"{confined.MARGIN_BYTES >> 20} MB + {confined.THREAD_MARGIN_BYTES >> 20} MB per thread, "
            f"kill grace {confined.KILL_GRACE_S:g} s; parent RSS "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MB"
        )
        print("| query | how it ended | seconds (median, range) | peak RSS of the query's process |")
        print("|---|---|---|---|")
        for sql in QUERIES:
            times, peaks, ended = [], [], ""
            for _ in range(args.repeats):
                began = time.perf_counter()
                try:
                    run_readonly_sql(path, sql, memory_limit=args.memory_limit, timeout_s=args.timeout)
                    ended = "answered"
                except StoreError as error:
                    ended = str(error).split(";")[0][:90]
                times.append(time.perf_counter() - began)
                peaks.append((confined.last_peak_bytes() or 0) >> 20)
            print(f"| `{sql}` | {ended} | {median(times):.2f} ({min(times):.2f}–{max(times):.2f}) | {max(peaks)} MB |")


if __name__ == "__main__":
    main()
