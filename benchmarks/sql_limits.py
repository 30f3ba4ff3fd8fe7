"""Do `sql`'s memory, time and size limits hold, and what does the caller pay?

    python benchmarks/sql_limits.py [--memory-limit 1GB|default] [--timeout 10] [--repeats 3]
        [--address-space 8GiB] [--only WORD]

Runs, through ``run_readonly_sql`` (the path of `headatlas sql`, `run.sql()`, the API and the web),
on an empty database: values built outside DuckDB's buffer manager (a 400-million-element list, a
4 GB string, format's and printf's 2 GB padding, a 300-million-element string_split), a long scan
that DuckDB interrupts, a statement costly to parse (2,000 CTEs), one nested 900 deep, and a 500 MB
answer. Prints, per query, how it ended, the seconds until the answer or error came back (median and
range), the peak resident memory of the query's process (``confined.last_peak_bytes``) and this
process's own peak growth during the call (``/proc/self/clear_refs`` resets the peak before each).
``--address-space`` first caps this process's address space, soft and hard (a shell's ``ulimit -v``);
``--memory-limit default`` uses sql's default.
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
from headatlas.service.storage.readonly import _bytes, run_readonly_sql  # noqa: E402
from headatlas.service.storage.store import Store  # noqa: E402

QUERIES = {
    "list": "SELECT len(range(0, 400000000))",  # a list of 400 million elements
    "string": "SELECT length(repeat('x', 4000000000))",  # a 4 GB string
    "format": "SELECT length(format('{:>2000000000}', 'x'))",
    "printf": "SELECT length(printf('%2000000000d', 1))",
    "string_split": "SELECT len(string_split(repeat('a,', 300000000), ','))",
    "scan": "SELECT count(*) FROM range(100000000000)",  # a long scan that DuckDB interrupts
    "ctes": "WITH " + ",".join(f"a{i} AS(SELECT 1)" for i in range(2000)) + " SELECT 1",  # 45 KB
    "nested": "SELECT " + "+".join(["1"] * 900),
    "wide": "SELECT repeat('x', 500000) || range AS s FROM range(1000)",  # a 500 MB answer
}


def _peak_now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory-limit", default="1GB")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--address-space", default=None)
    parser.add_argument("--only", default=None, help="the queries whose name holds this word")
    args = parser.parse_args()
    if args.address_space:
        cap = _bytes(args.address_space)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    memory = None if args.memory_limit == "default" else args.memory_limit
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "empty.duckdb"
        db.upgrade(Store(path).backend)
        run_readonly_sql(path, "SELECT 1")  # the helper started: what follows is the queries' own
        print(
            f"memory limit {args.memory_limit}, timeout {args.timeout:g} s, address space "
            f"{args.address_space or 'unlimited'}, margin {confined.MARGIN_BYTES >> 20} MB + "
            f"{confined.THREAD_MARGIN_BYTES >> 20} MB per thread, kill grace {confined.KILL_GRACE_S:g} s; "
            f"caller RSS {_peak_now() >> 20} MB"
        )
        print("| query | how it ended | seconds (median, range) | peak RSS, query's process | caller's peak growth |")
        print("|---|---|---|---|---|")
        for name, sql in QUERIES.items():
            if args.only and args.only not in name:
                continue
            times, peaks, grown, ended = [], [], [], ""
            for _ in range(args.repeats):
                _reset_peak()
                base = _peak_now()
                began = time.perf_counter()
                try:
                    rows = run_readonly_sql(path, sql, memory_limit=memory, timeout_s=args.timeout).rows
                    ended = f"answered, {len(rows)} rows"
                except StoreError as error:
                    ended = str(error).split(";")[0][:100]
                except RecursionError as error:
                    ended = f"RecursionError: {error}"[:100]
                times.append(time.perf_counter() - began)
                peaks.append((confined.last_peak_bytes() or 0) >> 20)
                grown.append((_peak_now() - base) >> 20)
            shown = sql if len(sql) < 70 else f"{sql[:60]}… ({len(sql):,} chars)"
            print(
                f"| `{shown}` | {ended} | {median(times):.2f} ({min(times):.2f}–{max(times):.2f}) | "
                f"{max(peaks)} MB | {max(grown)} MB |"
            )


if __name__ == "__main__":
    main()
